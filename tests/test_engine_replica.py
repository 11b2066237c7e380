"""The parts of EngineReplica (ray_serve/replica.py) that need no Ray cluster: the buffer that carries
prefix-cache events from the engine thread to the hub, and the health check Ray calls."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from tachyllm.ray_serve.hub import RoutingHub  # noqa: E402
from tachyllm.ray_serve.replica import CacheEventBuffer, EngineReplica  # noqa: E402


def test_the_first_report_is_the_whole_set_then_changes_latest_first():
    buffer = CacheEventBuffer([b"a", b"b"])
    buffer.add([b"c"], [b"a"])  # before the first report: the set is still being built
    assert sorted(buffer.take()[0]) == [b"b", b"c"]
    buffer.add([b"d"], [b"b"])
    buffer.add([b"b"], [b"d"])  # b came back, d left: only the latest state of each hash
    stored, evicted, reset = buffer.take()
    assert (stored, evicted, reset) == ([b"b"], [b"d"], False)
    assert buffer.take() == ([], [], False)


def test_a_report_that_could_not_be_sent_goes_again_under_later_events():
    buffer = CacheEventBuffer([b"a"])
    first = buffer.take()
    buffer.add([b"b"], [])
    buffer.restore(*first)  # the whole-set report failed: the next one is a whole set again
    buffer.add([], [b"a"])
    stored, evicted, reset = buffer.take()
    assert reset and stored == [b"b"] and evicted == []
    buffer.add([b"c"], [])
    lost = buffer.take()
    buffer.add([], [b"c"])
    buffer.restore(*lost)  # c was evicted after the lost report said it was stored: evicted wins
    assert buffer.take() == ([], [b"c"], False)


def test_the_hub_replays_by_cursor_and_resets_a_router_that_fell_behind():
    hub = RoutingHub(max_log=4, stale_after_s=60)
    hub.publish("d", "r1", [b"a", b"b"], [], True, b"m1", 11)
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
    assert hub.index_size("d") == 0 and hub.metrics("d") == []


class FakeEngine:
    def __init__(self, running: bool, busy: float) -> None:
        self.is_running, self._busy, self.error = running, busy, None if running else RuntimeError("boom")

    def busy_seconds(self) -> float:
        return self._busy


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
