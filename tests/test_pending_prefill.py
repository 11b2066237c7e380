"""The ledger of prompt blocks owed to each replica before routed requests' first tokens (without Ray)."""

from __future__ import annotations

from tachyllm.ray_serve.pending_prefill import PendingPrefill
from tachyllm.ray_serve.router_metrics import router_metrics


def gauge(model: str) -> float:
    return router_metrics().pending_prefill_blocks.labels(model)._value.get()


def test_blocks_are_owed_per_replica_until_settled() -> None:
    ledger = PendingPrefill()
    ledger.add("a", "m1", "r1", 5)
    ledger.add("b", "m1", "r1", 3)
    ledger.add("c", "m2", "r2", 7)
    assert (ledger.blocks("r1"), ledger.blocks("r2"), ledger.blocks("r3")) == (8, 7, 0)
    assert (gauge("m1"), gauge("m2")) == (8, 7)
    ledger.done("a")
    ledger.done("a")  # the first token, then the request's end: settled once
    assert ledger.blocks("r1") == 3 and gauge("m1") == 3
    ledger.add("b", "m1", "r1", 4)  # recorded again: replaces, never adds up
    assert ledger.blocks("r1") == 4


def test_a_dead_replica_owes_nothing() -> None:
    ledger = PendingPrefill()
    ledger.add("a", "m3", "r1", 5)
    ledger.add("b", "m3", "r2", 2)
    ledger.forget("r1")
    assert (ledger.blocks("r1"), ledger.blocks("r2"), gauge("m3")) == (0, 2, 2)


def test_an_attempt_settled_before_it_was_recorded_is_not_owed_later() -> None:
    """The router records a request when Ray reports it routed; should its first token (or its end)
    come first, the late record must not leave its blocks owed for ever."""
    ledger = PendingPrefill()
    ledger.done("early")
    ledger.add("early", "m4", "r1", 9)
    assert ledger.blocks("r1") == 0 and gauge("m4") == 0
