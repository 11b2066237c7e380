"""RoutingHub: the Ray actor through which a model's replicas tell its routers which KV blocks they hold,
and through which the ingress collects the replicas' metrics.

Ray Serve's own routing stats are polled by its controller and a router sees only their latest
snapshot, which cannot carry a stream of store/evict events; so each replica sends its batch of
events here every event interval, and each router (one per ingress process) reads the batches it has
not seen, by cursor. The hub keeps every replica's current block set, so a router that falls behind
the bounded log (or starts late) gets the full sets instead of the lost batches. A replica that has
not reported for `stale_after_s` (it died) is dropped, and routers are told to forget it.

Replicas send their metrics once a second; a scrape asks each for metrics rendered after the scrape
began (the answer to its next report says so, and the replica reports again at once) and waits for
them, so that a scrape counts everything the client was answered before it, as on a single server
(whose metrics are updated before an answer goes out), and the replicas' counters are comparable with
the routers' (prefix hits with the router's matched blocks, say), which the ingress counts at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

# A router's view of one update: (replica, stored hashes, evicted hashes, reset). reset: the stored
# hashes are the replica's whole block set (replace what is known of it); a reset with no hashes
# and `forget` semantics is sent as (replica, [], [], True).
Update = tuple[str, list[bytes], list[bytes], bool]


# How often a scrape looks whether every replica's fresh metrics have come.
FRESH_METRICS_POLL_S = 0.01


@dataclass
class _Replica:
    blocks: set[bytes] = field(default_factory=set)
    metrics: bytes = b""
    metrics_scrape: int = 0  # the latest scrape its metrics were rendered for (rendered after it began)
    pid: int = 0
    last_seen: float = 0.0


@dataclass(frozen=True)
class PublishReply:
    needs_full: bool  # the hub did not know the replica: send the whole block set
    metrics_wanted: int  # a scrape waits for metrics rendered after this one (0: none); send them now


class RoutingHub:
    """Plain class; routing_hub() makes it the application's named Ray actor."""

    def __init__(self, max_log: int = 4096, stale_after_s: float = 10.0) -> None:
        self._max_log = max_log
        self._stale_after_s = stale_after_s
        self._replicas: dict[str, dict[str, _Replica]] = {}  # deployment -> replica id -> state
        self._log: dict[str, list[Update]] = {}  # deployment -> recent updates
        self._log_start: dict[str, int] = {}  # deployment -> cursor of _log[deployment][0]
        self._scrapes: dict[str, int] = {}  # deployment -> the number of the latest scrape

    def publish(
        self,
        deployment: str,
        replica: str,
        stored: list[bytes],
        evicted: list[bytes],
        reset: bool,
        metrics: bytes,
        pid: int,
        metrics_scrape: int = 0,
    ) -> PublishReply:
        """One replica's report: its cache events since its previous report (reset: its whole block
        set, which it sends first), its Prometheus metrics (empty: unchanged) and the scrape they were
        rendered for (metrics_wanted of an earlier reply; 0: none), its process id. Replies whether the
        hub needs the replica's whole block set (it did not know the replica: the hub restarted, or had
        taken the replica for dead), and which scrape waits for its metrics."""
        replicas = self._replicas.setdefault(deployment, {})
        known = replica in replicas
        state = replicas.setdefault(replica, _Replica())
        if reset:
            state.blocks = set(stored)
        else:
            state.blocks.update(stored)
            state.blocks.difference_update(evicted)
        if metrics:
            state.metrics = metrics
            state.metrics_scrape = max(state.metrics_scrape, metrics_scrape)
        state.pid, state.last_seen = pid, time.monotonic()
        if stored or evicted or reset:
            self._append(deployment, (replica, stored, evicted, reset))
        self._drop_stale(deployment)
        scrape = self._scrapes.get(deployment, 0)
        return PublishReply(not known and not reset, scrape if scrape > state.metrics_scrape else 0)

    def updates(self, deployment: str, cursor: int) -> tuple[int, list[Update]]:
        """The updates after `cursor` (start with 0) and the cursor to ask with next time. A cursor older
        than the log gets every replica's full block set, as resets."""
        self._drop_stale(deployment)
        log = self._log.get(deployment, [])
        start = self._log_start.get(deployment, 0)
        end = start + len(log)
        if start <= cursor <= end:
            return end, log[cursor - start :]
        replicas = self._replicas.get(deployment, {})
        return end, [(replica, list(state.blocks), [], True) for replica, state in replicas.items()]

    def forget(self, deployment: str, replica: str) -> None:
        """Ray reported the replica dead (a router saw it): its blocks are gone."""
        if self._replicas.get(deployment, {}).pop(replica, None) is not None:
            self._append(deployment, (replica, [], [], True))

    async def metrics(self, deployment: str, wait_s: float = 0.0) -> list[tuple[str, bytes]]:
        """(replica, Prometheus exposition) of each live replica: rendered after this call began, for
        each replica that sends them within `wait_s` (a replica that does not, a hung one, is given as
        of its last report)."""
        scrape = self._scrapes[deployment] = self._scrapes.get(deployment, 0) + 1
        deadline = time.monotonic() + wait_s
        self._drop_stale(deployment)  # no waiting for a replica already taken for dead
        while time.monotonic() < deadline and any(
            state.metrics_scrape < scrape for state in self._replicas.get(deployment, {}).values()
        ):
            await asyncio.sleep(FRESH_METRICS_POLL_S)
        self._drop_stale(deployment)
        return [(replica, state.metrics) for replica, state in self._replicas.get(deployment, {}).items()]

    def replica_pids(self, deployment: str) -> dict[str, int]:
        return {replica: state.pid for replica, state in self._replicas.get(deployment, {}).items()}

    def _append(self, deployment: str, update: Update) -> None:
        log = self._log.setdefault(deployment, [])
        log.append(update)
        if len(log) > self._max_log:
            drop = len(log) - self._max_log // 2
            del log[:drop]
            self._log_start[deployment] = self._log_start.get(deployment, 0) + drop

    def _drop_stale(self, deployment: str) -> None:
        now = time.monotonic()
        replicas = self._replicas.get(deployment, {})
        for replica in [r for r, state in replicas.items() if now - state.last_seen > self._stale_after_s]:
            self.forget(deployment, replica)


def hub_actor_name(app_name: str) -> str:
    return f"tachyllm-routing-hub-{app_name}"


def routing_hub(app_name: str):
    """The application's hub actor, created by whoever asks first (replicas and routers all ask).
    Detached, so that it outlives any one replica; it restarts if its process dies."""
    import ray

    actor = ray.remote(RoutingHub).options(
        name=hub_actor_name(app_name),
        namespace="serve",
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_restarts=-1,
    )
    return actor.remote()
