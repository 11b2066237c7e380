"""The prompt blocks each replica still has to compute for the requests routed to it from this process.

A request's uncached blocks (its prompt blocks minus those its replica held when it was routed) are
owed from the moment the router sends it until its first token reaches the ingress (or it ends, or
fails): that is the prefill work standing between a new request and its own first token on that
replica. Requests that are decoding are not counted: on a replica their tokens ride in the same steps
as a new prompt's chunks instead of running before them.

Entries are keyed by the engine request id of each attempt (a retry has its own), which both the router
(from the call's arguments) and the RemoteStream (which made the id) know. The router runs on Ray's
router thread and the streams on the ingress's event loop, hence the lock. Only this process's
requests are here: with several ingress replicas, each routes on what it sent itself (and on Ray's
queue lengths, which count every caller's requests).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict, defaultdict

from tachyllm.ray_serve.router_metrics import router_metrics

# Attempts already settled, remembered so that one whose first token (or end) came before the router
# recorded it is not then owed for ever.
MAX_SETTLED = 4096


class PendingPrefill:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[str, str, int]] = {}  # attempt id -> (model, replica, blocks)
        self._by_replica: dict[str, int] = defaultdict(int)
        self._by_model: dict[str, int] = defaultdict(int)
        self._settled: OrderedDict[str, None] = OrderedDict()

    def add(self, attempt_id: str, model: str, replica: str, blocks: int) -> None:
        """The request went to `replica` with `blocks` prompt blocks to compute there."""
        with self._lock:
            if attempt_id in self._settled:
                return
            self._remove(attempt_id)
            self._entries[attempt_id] = (model, replica, blocks)
            self._by_replica[replica] += blocks
            self._by_model[model] += blocks
            self._publish(model)

    def done(self, attempt_id: str) -> None:
        """Its first token arrived, or it ended or failed without one; a second call does nothing."""
        with self._lock:
            if (entry := self._remove(attempt_id)) is not None:
                self._publish(entry[0])
            self._settled[attempt_id] = None
            if len(self._settled) > MAX_SETTLED:
                self._settled.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica died: nothing owed there stands before a new request."""
        with self._lock:
            for attempt_id in [a for a, (_, r, _) in self._entries.items() if r == replica]:
                removed = self._remove(attempt_id)
                assert removed is not None, "an attempt of _entries"
                self._publish(removed[0])

    def blocks(self, replica: str) -> int:
        with self._lock:
            return self._by_replica.get(replica, 0)

    def _remove(self, attempt_id: str) -> tuple[str, str, int] | None:
        entry = self._entries.pop(attempt_id, None)
        if entry is not None:
            model, replica, blocks = entry
            self._by_replica[replica] -= blocks
            if not self._by_replica[replica]:
                del self._by_replica[replica]
            self._by_model[model] -= blocks
        return entry

    def _publish(self, model: str) -> None:
        router_metrics().pending_prefill_blocks.labels(model).set(self._by_model[model])


@functools.cache
def pending_prefill() -> PendingPrefill:
    """The process's one ledger: the router (pickled by value, so holding no module state of its own)
    and the RemoteStreams share it."""
    return PendingPrefill()
