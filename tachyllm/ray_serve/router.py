"""Ray Serve request routers for engine replicas: PrefixCacheRouter (precise prefix-cache-aware routing)
and RoundRobinRouter (the baseline it is measured against, with Ray's default power-of-two router).

A router lives in each process that calls the engine deployment through a DeploymentHandle (the
ingress), on Ray's router event loop. PrefixCacheRouter keeps a PrefixIndex of the replicas' cached
blocks, fed by polling the RoutingHub, and reads a request's prompt block hashes from the arguments of
EngineReplica.generate (the ingress computes them with the replicas' own hash chain).

Ray Serve ships a router class to the processes that use it by pickling its module by value, so this
module holds no state of its own (the metrics live in router_metrics.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tachyllm.ray_serve.hub import routing_hub
from tachyllm.ray_serve.pending_prefill import pending_prefill
from tachyllm.ray_serve.prefix_index import DECISIONS, LOAD_FALLBACK, PrefixIndex, RoutingDecision, choose_replica
from tachyllm.ray_serve.router_metrics import router_metrics

logger = logging.getLogger("tachyllm.ray_serve")

GENERATE = "generate"
MAX_UNSETTLED = 65536
# EngineReplica.generate(request_id, request, max_queued, block_hashes, adapter_marker)
REQUEST_ID_ARG = 0
BLOCK_HASHES_ARG = 3
ADAPTER_MARKER_ARG = 4


def ranked(first: RunningReplica, candidates: list[RunningReplica], queue_len) -> list[list[RunningReplica]]:
    """`first`, then the others from the shortest queue: where Ray sends the request if `first` is full."""
    rest = sorted((r for r in candidates if r is not first), key=queue_len)
    return [[first], *([r] for r in rest)]


class PrefixCacheRouter(RequestRouter):
    """Not FIFOMixin: that hands a chosen replica to the oldest pending request, not to the one it was
    chosen for (RemoteEngine gives every call its own id, which the base router matches on)."""

    def initialize_state(  # type: ignore[override]  # Ray passes request_router_kwargs as keywords
        self, deployment: str, model_name: str, load_margin: int, poll_interval_s: float
    ) -> None:
        self._deployment = deployment
        self._model_name = model_name
        self._load_margin = load_margin
        self._poll_interval_s = poll_interval_s
        self._index = PrefixIndex()
        self._cursor = 0
        self._poller: asyncio.Task | None = None
        # internal request id -> the decision made for it, counted once the request is routed (Ray
        # calls choose_replicas again while every chosen replica is full).
        self._decisions: dict[str, RoutingDecision] = {}
        # internal request id -> the engine request id its prefill is owed under (pending_prefill.py),
        # until Ray reports the request completed.
        self._attempts: dict[str, str] = {}
        for decision in DECISIONS:
            router_metrics().decisions.labels(model_name, decision)

    def _queue_len(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        if not candidate_replicas:
            return []
        hashes: list[bytes] = []
        counted_call = (
            pending_request
            if pending_request is not None and pending_request.metadata.call_method == GENERATE
            else None
        )
        marker = None
        if counted_call is not None and len(counted_call.args) > BLOCK_HASHES_ARG:
            hashes = counted_call.args[BLOCK_HASHES_ARG]
        if counted_call is not None and len(counted_call.args) > ADAPTER_MARKER_ARG:
            marker = counted_call.args[ADAPTER_MARKER_ARG]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        matched = self._index.matched_blocks(hashes, by_id)
        queues = {rid: self._queue_len(r) for rid, r in by_id.items()}
        pending = {rid: pending_prefill().blocks(rid) for rid in by_id}
        # A LoRA adapter's request: the replicas that have not published the adapter as loaded.
        without = set(by_id) - self._index.holders(marker) if marker is not None else frozenset()
        decision = choose_replica(matched, queues, self._load_margin, len(hashes), pending, without_adapter=without)
        if counted_call is not None:
            bounded_insert(self._decisions, counted_call.metadata.internal_request_id, decision)
        return ranked(by_id[decision.replica], candidate_replicas, self._queue_len)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        decision = self._decisions.pop(pending_request.metadata.internal_request_id, None)
        if decision is None:
            return
        # A full replica makes Ray send the request to the next in rank: count what it got.
        reason = decision.reason if replica_id.unique_id == decision.replica else LOAD_FALLBACK
        matched = decision.matched_blocks if replica_id.unique_id == decision.replica else 0
        attempt_id = pending_request.args[REQUEST_ID_ARG]
        pending_prefill().add(attempt_id, self._model_name, replica_id.unique_id, decision.prompt_blocks - matched)
        bounded_insert(self._attempts, pending_request.metadata.internal_request_id, attempt_id)
        router_metrics().decisions.labels(self._model_name, reason).inc()
        router_metrics().matched_blocks.labels(self._model_name).inc(matched)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        if (attempt_id := self._attempts.pop(internal_request_id, None)) is not None:
            pending_prefill().done(attempt_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for replica in self._index.replicas():
            if replica not in live:
                self._forget(replica)

    def _forget(self, replica: str) -> None:
        self._index.forget(replica)
        pending_prefill().forget(replica)
        try:
            routing_hub(self.app_name).forget.remote(self._deployment, replica)
        except Exception:  # Ray is shutting down
            logger.debug("could not tell the routing hub to forget replica %s", replica, exc_info=True)

    async def _poll(self) -> None:
        """Applies the hub's updates to the index, every poll interval, for as long as the router lives."""
        hub = None
        while True:
            try:
                hub = hub or routing_hub(self.app_name)
                self._cursor, updates = await hub.updates.remote(self._deployment, self._cursor)
                # A replica the router does not know yet (its first report came before Ray's update)
                # is indexed too: only candidates are ever matched.
                for replica, stored, evicted, reset in updates:
                    if reset:
                        self._index.reset(replica, stored)
                    else:
                        self._index.apply(replica, stored, evicted)
                router_metrics().index_size.labels(self._model_name).set(len(self._index))
            except Exception:  # the hub may be restarting: keep routing on what is known
                logger.warning("prefix router: could not read the routing hub", exc_info=True)
                hub = None
            await asyncio.sleep(self._poll_interval_s)


def bounded_insert(entries: dict, key, value) -> None:
    """Entries that Ray never settles (a request cancelled before it was routed) cannot pile up."""
    if len(entries) > MAX_UNSETTLED:
        del entries[next(iter(entries))]
    entries[key] = value


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn, whatever it holds (a baseline for benchmarks)."""

    def initialize_state(self, **kwargs) -> None:
        self._turn = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        first = ordered[next(self._turn) % len(ordered)]
        return ranked(first, ordered, lambda r: 0)
