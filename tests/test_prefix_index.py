"""The prefix-aware router's index and choice, without Ray: exact block matches, the load guard, forgetting."""

from __future__ import annotations

import random

import pytest

from tachyllm.core.block_manager import hash_block
from tachyllm.ray_serve.prefix_index import (
    LOAD_FALLBACK,
    NO_MATCH,
    PREFIX_HIT,
    PrefixIndex,
    adapter_marker,
    choose_replica,
)


def _chain(tokens: list[int], block_size: int = 4) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * block_size : (i + 1) * block_size], b""))
    return hashes


def test_matches_count_blocks_from_the_start_only() -> None:
    a = _chain(list(range(16)))  # 4 blocks
    index = PrefixIndex()
    index.apply("r1", stored=a[:3])
    index.apply("r2", stored=a)
    index.apply("r3", stored=a[1:])  # lacks the first block: holds no usable prefix
    assert index.matched_blocks(a, ["r1", "r2", "r3", "r4"]) == {"r1": 3, "r2": 4, "r3": 0, "r4": 0}
    # A prompt that shares the first two blocks, then differs.
    b = _chain(list(range(8)) + [99] * 8)
    assert index.matched_blocks(b, ["r1", "r2"]) == {"r1": 2, "r2": 2}
    assert len(index) == 3 + 4 + 3


def test_evictions_and_forgetting_remove_blocks() -> None:
    a = _chain(list(range(16)))
    index = PrefixIndex()
    index.apply("r1", stored=a)
    index.apply("r1", evicted=[a[2]])
    assert index.matched_blocks(a, ["r1"]) == {"r1": 2}
    index.apply("r2", stored=a)
    index.forget("r2")
    assert index.matched_blocks(a, ["r2"]) == {"r2": 0}
    assert index.replicas() == ["r1"]
    index.reset("r1", a[:1])
    assert index.matched_blocks(a, ["r1"]) == {"r1": 1}
    assert len(index) == 1


def idle(*replicas: str) -> dict[str, int]:
    return dict.fromkeys(replicas, 0)


def test_the_least_work_ahead_wins() -> None:
    # r2 lacks 7 of the 10 blocks and has 1 block of another prompt to compute first: 8 blocks, r1 9.
    decision = choose_replica({"r1": 1, "r2": 3}, {"r1": 0, "r2": 4}, 4, 10, {"r1": 0, "r2": 1})
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r2", PREFIX_HIT, 3)
    # 3 more blocks pending on r2: r1 is now cheaper, though it holds less.
    decision = choose_replica({"r1": 1, "r2": 3}, {"r1": 0, "r2": 4}, 4, 10, {"r1": 0, "r2": 4})
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r1", PREFIX_HIT, 1)


def test_a_conversation_stays_with_its_history_while_its_replica_is_busy() -> None:
    # 60 of 73 blocks held by r1, which is computing another turn of 13 blocks: 26 blocks of work vs 73.
    decision = choose_replica({"r1": 60, "r2": 0}, {"r1": 3, "r2": 0}, 8, 73, {"r1": 13, "r2": 0})
    assert (decision.replica, decision.reason) == ("r1", PREFIX_HIT)
    # Queued requests that already stream their tokens cost nothing ahead of the first token.
    decision = choose_replica({"r1": 60, "r2": 0}, {"r1": 6, "r2": 0}, 8, 73, idle("r1", "r2"))
    assert (decision.replica, decision.reason) == ("r1", PREFIX_HIT)


def test_one_shared_template_block_does_not_pull_new_chats_onto_a_busy_replica() -> None:
    """Every chat starts with the same system-prompt block; its holder is computing another prompt, so
    a new chat goes to the idle replica (the longest-prefix rule alone sent every chat to the first)."""
    decision = choose_replica({"r1": 1, "r2": 0}, {"r1": 1, "r2": 0}, 8, 14, {"r1": 12, "r2": 0})
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r2", LOAD_FALLBACK, 0)
    # Idle holder: it saves a block of work.
    decision = choose_replica({"r1": 1, "r2": 0}, {"r1": 1, "r2": 0}, 8, 14, idle("r1", "r2"))
    assert (decision.replica, decision.reason) == ("r1", PREFIX_HIT)


def test_new_chats_arriving_together_spread_evenly_though_all_share_a_first_block() -> None:
    queues = idle("r1", "r2", "r3")
    pending = idle("r1", "r2", "r3")
    held: dict[str, int] = {}
    rng = random.Random(2)
    for _ in range(30):
        matched = {r: held.get(r, 0) for r in queues}
        decision = choose_replica(matched, queues, 8, 14, pending, rng=rng)
        held[decision.replica] = 1
        queues[decision.replica] += 1
        pending[decision.replica] += 14 - decision.matched_blocks  # none has its first token yet
        assert max(queues.values()) - min(queues.values()) <= 1


def test_equal_work_goes_to_the_shorter_queue_then_to_either() -> None:
    decision = choose_replica({"r1": 2, "r2": 2}, {"r1": 3, "r2": 1}, 8, 5, {"r1": 1, "r2": 1})
    assert decision.replica == "r2"
    chosen = {
        choose_replica({"r1": 2, "r2": 2}, {"r1": 1, "r2": 1}, 8, 5, {"r1": 1, "r2": 1}, random.Random(seed)).replica
        for seed in range(20)
    }
    assert chosen == {"r1", "r2"}


def test_a_busy_replica_is_passed_over_for_the_less_loaded() -> None:
    # r2 holds the prefix and is cheapest, but has 5 more requests queued than the idlest replica:
    # load margin 4 exceeded.
    decision = choose_replica({"r1": 0, "r2": 3}, {"r1": 0, "r2": 5}, 4, 100, idle("r1", "r2"), random.Random(0))
    assert (decision.replica, decision.reason) == ("r1", LOAD_FALLBACK)


def test_a_hot_prefix_spreads_once_its_replica_fills_up() -> None:
    """Every request shares one prefix: requests go to its holder until its queue leads by the
    margin, then spread; the holder never gets more than margin + 1 requests ahead."""
    queues = idle("r1", "r2", "r3")
    rng = random.Random(1)
    for _ in range(60):
        matched = {"r1": 5, "r2": 0, "r3": 0}
        queues[choose_replica(matched, queues, 2, 5, idle("r1", "r2", "r3"), rng).replica] += 1
        assert queues["r1"] - min(queues.values()) <= 3
    assert queues["r1"] > queues["r2"] and queues["r1"] > queues["r3"]


def test_no_match_takes_the_least_work_ahead_under_the_load_guard() -> None:
    decision = choose_replica(idle("r1", "r2"), {"r1": 1, "r2": 3}, 4, 6, {"r1": 9, "r2": 0})
    assert (decision.replica, decision.reason) == ("r2", NO_MATCH)
    decision = choose_replica(idle("r1", "r2"), {"r1": 3, "r2": 1}, 4, 6, idle("r1", "r2"))
    assert (decision.replica, decision.reason) == ("r2", NO_MATCH)
    # The idle-prefill replica has 5 more requests queued than the other: the guard passes it over.
    decision = choose_replica(idle("r1", "r2"), {"r1": 0, "r2": 5}, 4, 6, {"r1": 9, "r2": 0})
    assert (decision.replica, decision.reason) == ("r1", NO_MATCH)
    with pytest.raises(ValueError):
        choose_replica({}, {}, 1, 0, {})


def test_adapter_requests_prefer_a_replica_with_the_adapter_loaded() -> None:
    """Equal prefix work: the replica that published the adapter's marker, whichever the random draw;
    a held prefix longer than the load's charge still wins."""
    index = PrefixIndex()
    marker = adapter_marker(b"digest of sql")
    index.apply("r2", stored=[marker])
    assert index.holders(marker) == {"r2"} and index.holders(adapter_marker(b"other")) == set()
    without = {"r1", "r3"}
    for seed in range(8):
        rng = random.Random(seed)
        decision = choose_replica(idle("r1", "r2", "r3"), idle("r1", "r2", "r3"), 8, 4, idle("r1", "r2", "r3"), rng,
                                  without_adapter=without)  # fmt: skip
        assert decision.replica == "r2" and decision.reason == NO_MATCH
    decision = choose_replica({"r1": 3, "r2": 0, "r3": 0}, idle("r1", "r2", "r3"), 8, 4, idle("r1", "r2", "r3"),
                              without_adapter=without)  # fmt: skip
    assert decision.replica == "r1" and decision.reason == PREFIX_HIT
    index.apply("r2", evicted=[marker])
    assert index.holders(marker) == set()
