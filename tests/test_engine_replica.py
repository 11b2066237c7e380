"""The parts of EngineReplica (ray_serve/replica.py) that need no Ray cluster: the buffer that carries
prefix-cache events from the engine thread to the hub, the hub itself, and the health check Ray calls."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ray")

from tachyllm.ray_serve.hub import RoutingHub  # noqa: E402
from tachyllm.ray_serve.replica import CacheEventBuffer, EngineReplica  # noqa: E402


class FakeBlockManager:
    """What CacheEventBuffer reads of a BlockManager: its cached hashes and its drained events."""

    def __init__(self) -> None:
        self.cached: set[bytes] = set()
        self.events: dict[bytes, bool] = {}

    def store(self, *hashes: bytes) -> None:
        for h in hashes:
            self.cached.add(h)
            self.events[h] = True

    def evict(self, *hashes: bytes) -> None:
        for h in hashes:
            self.cached.discard(h)
            self.events[h] = False

    def track_cache_events(self) -> list[bytes]:
        self.events = {}
        return list(self.cached)

    def drain_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        events, self.events = self.events, {}
        return [h for h, on in events.items() if on], [h for h, on in events.items() if not on]


def test_the_first_report_is_the_whole_set_then_changes_latest_first():
    blocks, buffer = FakeBlockManager(), CacheEventBuffer()
    blocks.store(b"a", b"b")
    blocks.evict(b"a")
    buffer.drain(blocks)
    assert buffer.take() == ([b"b"], [], True)  # a whole set: what it lacks is not cached
    blocks.store(b"d")
    blocks.evict(b"b")
    buffer.drain(blocks)
    blocks.store(b"b")
    blocks.evict(b"d")
    buffer.drain(blocks)  # b came back, d left: only the latest state of each hash
    assert buffer.take() == ([b"b"], [b"d"], False)
    assert buffer.take() == ([], [], False)


def test_a_report_that_could_not_be_sent_goes_again_under_later_events():
    blocks, buffer = FakeBlockManager(), CacheEventBuffer()
    blocks.store(b"a")
    buffer.drain(blocks)
    first = buffer.take()
    blocks.store(b"b")
    blocks.evict(b"a")
    buffer.drain(blocks)
    buffer.restore(*first)  # the whole-set report failed: the next one is a whole set again
    assert buffer.take() == ([b"b"], [], True)
    blocks.store(b"c")
    buffer.drain(blocks)
    lost = buffer.take()
    blocks.evict(b"c")
    buffer.drain(blocks)
    buffer.restore(*lost)  # c was evicted after the lost report said it was stored: evicted wins
    assert buffer.take() == ([], [b"c"], False)


def test_loaded_adapters_reported_among_the_blocks():
    """A LoRA adapter's marker is stored while the engine has it loaded, evicted once it is not, and part
    of a full snapshot."""
    blocks, buffer = FakeBlockManager(), CacheEventBuffer()
    buffer.drain(blocks)
    buffer.take()
    blocks.store(b"a")
    buffer.drain(blocks, frozenset({b"sql"}))
    buffer.drain(blocks, frozenset({b"sql"}))  # still loaded: nothing new
    assert buffer.take() == ([b"a", b"sql"], [], False)
    buffer.drain(blocks, frozenset({b"chat"}))  # sql evicted for chat
    assert buffer.take() == ([b"chat"], [b"sql"], False)
    buffer.want_full()
    buffer.drain(blocks, frozenset({b"chat"}))
    assert sorted(buffer.take()[0]) == [b"a", b"chat"]
    buffer.drain(blocks)
    assert buffer.take() == ([], [b"chat"], False)


def test_a_full_snapshot_on_request():
    blocks, buffer = FakeBlockManager(), CacheEventBuffer()
    buffer.drain(blocks)
    buffer.take()
    blocks.store(b"x", b"y")
    buffer.want_full()  # the hub lost this replica: the next drain sends everything cached
    buffer.drain(blocks)
    stored, evicted, reset = buffer.take()
    assert sorted(stored) == [b"x", b"y"] and evicted == [] and reset


def test_the_hub_replays_by_cursor_and_resets_a_router_that_fell_behind():
    hub = RoutingHub(max_log=4, stale_after_s=60)
    assert hub.publish("e", "r2", [b"z"], [], False, b"", 12).needs_full  # unknown, not a whole set: ask for one
    assert not hub.publish("d", "r1", [b"a", b"b"], [], True, b"m1", 11).needs_full
    cursor, updates = hub.updates("d", 0)
    assert updates == [("r1", [b"a", b"b"], [], True)]
    for i in range(6):  # past the log's bound
        hub.publish("d", "r1", [bytes([i])], [b"a"] if i == 0 else [], False, b"m1", 11)
    _, updates = hub.updates("d", cursor)  # too old: the whole set instead
    assert (
        len(updates) == 1
        and updates[0][3]
        and sorted(updates[0][1]) == sorted([b"b", *map(bytes, [[i] for i in range(6)])])
    )
    hub.forget("d", "r1")
    assert hub.updates("d", 0)[1] == [] and asyncio.run(hub.metrics("d")) == [] and hub.replica_pids("d") == {}


def test_a_scrape_waits_for_metrics_rendered_after_it_began():
    """Replicas send metrics once a second; a scrape asks each for current ones (in the answer to its next
    report) and waits for them, so that it counts every answer the client had before it."""
    hub = RoutingHub(stale_after_s=60)
    hub.publish("d", "r1", [], [], True, b"r1 old", 11)
    hub.publish("d", "r2", [], [], True, b"r2 old", 12)

    async def scrape_while_replicas_report() -> tuple[list, list]:
        scrape = asyncio.create_task(hub.metrics("d", wait_s=30))
        await asyncio.sleep(0.05)
        asked = [hub.publish("d", r, [], [], False, b"", 0).metrics_wanted for r in ("r1", "r2")]
        assert all(asked) and not scrape.done()  # each replica was asked; neither has answered
        hub.publish("d", "r1", [], [], False, b"r1 periodic", 11)  # rendered before it was asked: not it
        hub.publish("d", "r1", [], [], False, b"r1 new", 11, asked[0])
        await asyncio.sleep(0.05)
        assert not scrape.done()  # r2 still owes its current metrics
        assert hub.publish("d", "r2", [], [], False, b"r2 new", 12, asked[1]).metrics_wanted == 0
        return await asyncio.wait_for(scrape, 5), asked

    reports, asked = asyncio.run(scrape_while_replicas_report())
    assert dict(reports) == {"r1": b"r1 new", "r2": b"r2 new"}
    assert hub.publish("d", "r1", [], [], False, b"", 11).metrics_wanted == 0  # nobody waits any more


def test_a_scrape_does_not_wait_for_ever_on_a_silent_replica():
    hub = RoutingHub(stale_after_s=60)
    hub.publish("d", "r1", [], [], True, b"r1 old", 11)
    started = time.monotonic()
    assert asyncio.run(hub.metrics("d", wait_s=0.3)) == [("r1", b"r1 old")]  # as of its last report
    assert 0.3 <= time.monotonic() - started < 5


class FakeEngine:
    def __init__(self, running: bool, busy: float) -> None:
        self.is_running, self._busy, self.error = running, busy, None if running else RuntimeError("boom")

    def busy_seconds(self) -> float:
        return self._busy

    def shutdown(self, timeout: float) -> None:  # the replica's __del__ stops its engine
        pass


def replica(engine: FakeEngine, timeout: float) -> EngineReplica:
    r = object.__new__(EngineReplica)  # the constructor needs a Serve replica context
    r.engine, r._iteration_timeout = engine, timeout
    return r


def test_health_checks_call_the_engine():
    replica(FakeEngine(True, 5.0), 60.0).check_health()
    with pytest.raises(RuntimeError, match="engine stopped: boom"):
        replica(FakeEngine(False, 0.0), 60.0).check_health()
    with pytest.raises(RuntimeError, match="iteration has run for 90 s"):
        replica(FakeEngine(True, 90.0), 60.0).check_health()
    replica(FakeEngine(True, 90.0), 0.0).check_health()  # 0: no limit
