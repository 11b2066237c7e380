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


def test_the_longest_prefix_wins_over_a_short_queue() -> None:
    # r2 lacks 7 of the 10 blocks and has 4 requests of a quarter block each ahead: 8 blocks of work, r1 9.
    decision = choose_replica({"r1": 1, "r2": 3}, {"r1": 0, "r2": 4}, 4, 10, blocks_per_queued_request=1 / 4)
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r2", PREFIX_HIT, 3)


def test_a_conversation_stays_with_its_history_while_its_replica_is_busy() -> None:
    # 60 of 73 blocks held by r1, which has 3 requests of ~13 blocks each queued: 52 blocks of work vs 73.
    decision = choose_replica({"r1": 60, "r2": 0}, {"r1": 3, "r2": 0}, 8, 73, blocks_per_queued_request=13)
    assert (decision.replica, decision.reason) == ("r1", PREFIX_HIT)


def test_one_shared_template_block_does_not_pull_new_chats_onto_a_busy_replica() -> None:
    """Every chat starts with the same system-prompt block; its holder is busy, so a new chat goes to
    the idle replica (the longest-prefix rule alone sent every chat to the first replica)."""
    decision = choose_replica({"r1": 1, "r2": 0}, {"r1": 3, "r2": 0}, 8, prompt_blocks=14, blocks_per_queued_request=12)
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r2", LOAD_FALLBACK, 0)
    # Idle holder: it saves a block of work.
    decision = choose_replica({"r1": 1, "r2": 0}, {"r1": 0, "r2": 0}, 8, prompt_blocks=14, blocks_per_queued_request=12)
    assert (decision.replica, decision.reason) == ("r1", PREFIX_HIT)


def test_new_chats_spread_evenly_though_all_share_a_first_block() -> None:
    queues = {"r1": 0, "r2": 0, "r3": 0}
    held: dict[str, int] = {}
    rng = random.Random(2)
    for _ in range(30):
        matched = {r: held.get(r, 0) for r in queues}
        decision = choose_replica(matched, queues, 8, prompt_blocks=14, blocks_per_queued_request=14, rng=rng)
        held[decision.replica] = 1
        queues[decision.replica] += 1
        assert max(queues.values()) - min(queues.values()) <= 1


def test_equal_work_is_shared_out() -> None:
    chosen = {
        choose_replica({"r1": 2, "r2": 2}, {"r1": 1, "r2": 1}, 8, 5, 3, rng=random.Random(seed)).replica
        for seed in range(20)
    }
    assert chosen == {"r1", "r2"}


def test_a_busy_replica_is_passed_over_for_the_less_loaded() -> None:
    # r2 holds the prefix and is cheapest (queued requests counted free), but has 5 more requests
    # queued than the idlest replica: load margin 4 exceeded.
    decision = choose_replica({"r1": 0, "r2": 3}, {"r1": 0, "r2": 5}, 4, 100, 0, rng=random.Random(0))
    assert (decision.replica, decision.reason) == ("r1", LOAD_FALLBACK)


def test_a_hot_prefix_spreads_once_its_replica_fills_up() -> None:
    """Every request shares one prefix: requests go to its holder until its queue leads by the
    margin, then spread; the holder never gets more than margin + 1 requests ahead."""
    queues = {"r1": 0, "r2": 0, "r3": 0}
    rng = random.Random(1)
    for _ in range(60):
        matched = {"r1": 5, "r2": 0, "r3": 0}
        queues[choose_replica(matched, queues, 2, prompt_blocks=5, blocks_per_queued_request=0, rng=rng).replica] += 1
        assert queues["r1"] - min(queues.values()) <= 3
    assert queues["r1"] > queues["r2"] and queues["r1"] > queues["r3"]


def test_no_match_takes_the_less_loaded_of_two() -> None:
    decision = choose_replica({"r1": 0, "r2": 0}, {"r1": 3, "r2": 1}, 4, 6, 6, rng=random.Random(0))
    assert (decision.replica, decision.reason) == ("r2", NO_MATCH)
    with pytest.raises(ValueError):
        choose_replica({}, {}, 1, 0, 0)
