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


def test_the_longest_prefix_wins_within_the_load_margin() -> None:
    decision = choose_replica({"r1": 1, "r2": 3}, {"r1": 0, "r2": 4}, load_margin=4)
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r2", PREFIX_HIT, 3)


def test_a_busy_replica_is_passed_over_for_the_less_loaded() -> None:
    # r2 holds the prefix but has 5 more requests queued than the idlest replica: margin 4 exceeded.
    decision = choose_replica({"r1": 0, "r2": 3}, {"r1": 0, "r2": 5}, load_margin=4, rng=random.Random(0))
    assert (decision.replica, decision.reason) == ("r1", LOAD_FALLBACK)


def test_a_hot_prefix_spreads_once_its_replica_fills_up() -> None:
    """Every request shares one prefix: requests go to its holder until its queue leads by the
    margin, then spread; no replica gets more than margin + 1 requests ahead."""
    queues = {"r1": 0, "r2": 0, "r3": 0}
    rng = random.Random(1)
    for _ in range(60):
        matched = {"r1": 5, "r2": 0, "r3": 0}
        queues[choose_replica(matched, queues, load_margin=2, rng=rng).replica] += 1
        assert max(queues.values()) - min(queues.values()) <= 3
    assert queues["r1"] > queues["r2"] and queues["r1"] > queues["r3"]


def test_no_match_takes_the_less_loaded_of_two() -> None:
    decision = choose_replica({"r1": 0, "r2": 0}, {"r1": 3, "r2": 1}, load_margin=4, rng=random.Random(0))
    assert (decision.replica, decision.reason) == ("r2", NO_MATCH)
    with pytest.raises(ValueError):
        choose_replica({}, {}, load_margin=1)
