"""BlockManager: ref counts, the LRU free list, prefix-cache hits, and a hypothesis state machine.

The state machine drives the real BlockManager with fake sequences and a fake KV cache in which
every slot records the exact token prefix its KV was computed from. Whatever blocks the manager
hands out (fresh, shared or cached), every computed position must read back its own prefix; this
is the "a cached block holds exactly that request's prefix" property, checked on every operation,
also under a deliberately terrible hash that makes collisions the norm.
"""

from __future__ import annotations

import pytest
from helpers.scheduling import FakeKV, make_seq, prompts
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tachyllm.core import block_manager as bm_module
from tachyllm.core.block_manager import NULL_BLOCK, BlockManager, cdiv, hash_block
from tachyllm.core.sequence import Sequence


def weak_hash(parent: bytes | None, token_ids, extra_key: bytes) -> bytes:
    """Two possible values: nearly every lookup collides, across prefixes and positions."""
    return bytes([sum(token_ids) % 2])


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences go through match_prefix -> allocate -> compute -> commit, decode single tokens, get
    preempted (freed and reset) or freed for good, in any order; with or without a sliding-window pool."""

    @initialize(
        num_blocks=st.integers(3, 12),
        block_size=st.integers(1, 4),
        caching=st.booleans(),
        window=st.one_of(st.none(), st.integers(1, 9)),
        window_blocks=st.integers(2, 12),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool, window: int | None, window_blocks: int) -> None:
        """With a window, the sliding-window layers' pool of window_blocks (NULL_BLOCK included)."""
        window_blocks = window_blocks if window else 0
        self.bm = BlockManager(num_blocks, block_size, caching, window=window, window_blocks=window_blocks)
        self.kv = FakeKV(num_blocks, block_size)
        self.window_kv = FakeKV(window_blocks, block_size, window) if window else None
        self.live: list[Sequence] = []
        self.mirror = set(self.bm.track_cache_events())  # what a router learns from the events

    @rule(tokens=prompts)
    def add(self, tokens: list[int]) -> None:
        self.live.append(make_seq(tokens))

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.live))
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 6))
    def compute(self, index: int, chunk: int) -> None:
        pending = [s for s in self.live if s.num_uncomputed_tokens]
        seq = pending[index % len(pending)]
        prefix = []
        if not seq.block_table:
            prefix = self.bm.match_prefix(seq)
            assert len(set(prefix)) == len(prefix)
            assert len(prefix) * self.bm.block_size < seq.num_tokens  # at least one token is computed
            for i, block_id in enumerate(prefix):  # a hit holds exactly this sequence's prefix
                for off in range(self.bm.block_size):
                    p = i * self.bm.block_size + off
                    assert self.kv.slots[block_id][off] == tuple(seq.token_ids[: p + 1])
        start = seq.num_computed_tokens + len(prefix) * self.bm.block_size
        num_new = min(chunk, seq.num_tokens - start)
        bm = self.bm
        before = (list(seq.block_table), list(seq.window_block_table), bm.num_free_blocks, bm.num_free_window_blocks)
        cached_before = seq.num_cached_blocks
        if not bm.allocate(seq, num_new, prefix):
            # all or nothing
            assert before == (seq.block_table, seq.window_block_table, bm.num_free_blocks, bm.num_free_window_blocks)
            return
        assert seq.block_table[: len(before[0])] == before[0]
        assert seq.num_cached_blocks == cached_before + len(prefix)  # registered blocks stay registered
        assert seq.num_computed_tokens == start
        assert len(seq.block_table) * bm.block_size >= start + num_new
        for kv in filter(None, (self.kv, self.window_kv)):
            kv.check(seq, start)  # what the chunk's first query reads, a window hit's blocks included
            kv.write(seq, start, start + num_new)
        seq.num_computed_tokens += num_new
        bm.commit(seq)
        for kv in filter(None, (self.kv, self.window_kv)):
            kv.check(seq, seq.num_computed_tokens)
        if self.window_kv:  # at most the next query's window, straddling one block more
            held = len(seq.window_block_table) - seq.window_block_table.count(NULL_BLOCK)
            assert held <= cdiv(bm.window, bm.block_size) + 1

    @precondition(lambda self: any(s.block_table and not s.num_uncomputed_tokens for s in self.live))
    @rule(index=st.integers(0, 100), token=st.integers(0, 2))
    def sample(self, index: int, token: int) -> None:
        done = [s for s in self.live if s.block_table and not s.num_uncomputed_tokens]
        done[index % len(done)].token_ids.append(token)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def preempt(self, index: int) -> None:
        seq = self.live[index % len(self.live)]
        self.bm.free_seq(seq)
        seq.num_computed_tokens = 0

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        seq = self.live.pop(index % len(self.live))
        self.bm.free_seq(seq)
        assert seq.block_table == []

    @invariant()
    def cache_events_mirror_the_cache(self) -> None:
        stored, evicted = self.bm.drain_cache_events()
        assert not set(stored) & set(evicted)
        self.mirror = (self.mirror | set(stored)) - set(evicted)
        assert self.mirror == set(self.bm.cached)

    @invariant()
    def blocks_accounted_for(self) -> None:
        self.bm.check_invariants(self.live)
        referenced = {b for s in self.live for b in s.block_table}
        assert len(referenced) + self.bm.num_free_blocks == self.bm.num_blocks
        assert sum(b.ref_count for b in self.bm.blocks) == sum(len(s.block_table) for s in self.live)
        referenced = {b for s in self.live for b in s.window_block_table} - {NULL_BLOCK}
        assert len(referenced) + self.bm.num_free_window_blocks == self.bm.num_window_blocks

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            self.bm.free_seq(seq)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.num_free_window_blocks == self.bm.num_window_blocks


MACHINE_SETTINGS = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)


def test_block_manager_state_machine():
    run_state_machine_as_test(BlockManagerMachine, settings=MACHINE_SETTINGS)


def test_block_manager_state_machine_with_colliding_hashes(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", weak_hash)
    run_state_machine_as_test(BlockManagerMachine, settings=MACHINE_SETTINGS)


# -- unit tests --------------------------------------------------------------------------------


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence whose tokens are all computed (taking whatever prefix hits exist) and cached."""
    seq = make_seq(tokens)
    prefix = bm.match_prefix(seq)
    assert bm.allocate(seq, len(tokens) - len(prefix) * bm.block_size, prefix)
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    return seq


def test_finished_blocks_stay_cached_and_are_revived():
    bm = BlockManager(8, 4)
    first = computed(bm, list(range(10)))
    head = first.block_table[:2]
    bm.free_seq(first)
    assert bm.num_free_blocks == 8
    again = make_seq(list(range(8)) + [50, 51])
    assert bm.match_prefix(again) == head
    assert bm.allocate(again, 2, head)
    # The two revived blocks leave the free list along with the one new block.
    assert bm.num_free_blocks == 5 and again.num_computed_tokens == 8
    bm.check_invariants([again])


def test_at_least_one_token_is_computed():
    bm = BlockManager(8, 4)
    bm.free_seq(computed(bm, list(range(8))))
    assert len(bm.match_prefix(make_seq(list(range(8))))) == 1  # not 2: the last token must run
    assert len(bm.match_prefix(make_seq(list(range(9))))) == 2


def test_eviction_is_lru_and_tail_first():
    bm = BlockManager(4, 2)
    old = computed(bm, [1, 2, 3, 4])
    bm.free_seq(old)
    new = computed(bm, [5, 6, 7, 8])
    bm.free_seq(new)
    # Evicting one block takes the tail of the older prefix, so its head still hits.
    taker = make_seq([9, 9])
    assert bm.allocate(taker, 2)
    assert taker.block_table == [1]  # block 1 held [3, 4]
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 0])) == [0]
    assert len(bm.match_prefix(make_seq([5, 6, 7, 8, 0]))) == 2


def test_cache_events_report_stored_and_evicted_blocks():
    bm = BlockManager(4, 2)
    assert bm.drain_cache_events() == ([], [])  # not tracking: nothing recorded
    old = computed(bm, [1, 2, 3, 4])
    assert bm.track_cache_events() == list(bm.cached) and len(bm.cached) == 2
    bm.free_seq(old)
    new = computed(bm, [5, 6, 7, 8])
    stored, evicted = bm.drain_cache_events()
    assert stored == new.block_hashes and evicted == []
    bm.free_seq(new)
    assert bm.allocate(make_seq([9, 9]), 2)  # evicts the tail of [1, 2, 3, 4]
    assert bm.drain_cache_events() == ([], [old.block_hashes[1]])
    assert bm.drain_cache_events() == ([], [])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(3, 2)
    holder = computed(bm, [1, 2, 3, 4])
    seq = make_seq([7, 7, 7, 7])
    assert not bm.allocate(seq, 4)
    assert seq.block_table == [] and bm.num_free_blocks == 1
    bm.free_seq(holder)
    assert bm.allocate(seq, 4)


def test_double_free_is_caught():
    bm = BlockManager(4, 2)
    seq = computed(bm, [1, 2, 3])
    table = list(seq.block_table)
    bm.free_seq(seq)
    seq.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free_seq(seq)


def test_same_block_computed_twice_is_shared():
    """Two requests prefilling one prompt in the same step end up sharing one copy, and the tail
    of the second still chains to it, so a later request hits all of it."""
    bm = BlockManager(12, 2)
    a, b = make_seq([1, 2, 3, 4, 5]), make_seq([1, 2, 3, 4, 6, 6, 7])
    for seq in (a, b):
        assert bm.allocate(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
    assert b.block_table[:2] == a.block_table[:2]
    bm.check_invariants([a, b])
    assert bm.num_free_blocks == 12 - 3 - 2  # a: 3 blocks, b: 2 of its own
    hit = bm.match_prefix(make_seq([1, 2, 3, 4, 6, 6, 7, 8]))
    assert hit == b.block_table[:3]


def test_stale_parent_never_matches(monkeypatch):
    """A cached child whose parent block was evicted and refilled with other tokens does not chain
    to the new content, even when (as with this parent-blind hash) the lookup key would match."""
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens, extra: bytes(tokens))
    bm = BlockManager(3, 2)
    bm.free_seq(computed(bm, [1, 2, 3, 4]))  # block 0 = [1, 2] -> block 1 = [3, 4]
    bm.free.move_to_end(1)  # keep the child, so that the parent is evicted first
    holder = computed(bm, [5])  # takes block 2
    bm.free_seq(computed(bm, [8, 8]))  # block 0 now holds [8, 8]
    assert bm.blocks[1].token_ids == (3, 4)
    assert bm.match_prefix(make_seq([8, 8, 3, 4, 5])) == [0]
    bm.check_invariants([holder])


def test_extra_key_and_parent_change_the_hash():
    tokens = [1, 2, 3, 4]
    assert hash_block(None, tokens, b"bf16") != hash_block(None, tokens, b"f32")
    assert hash_block(None, tokens, b"") != hash_block(hash_block(None, tokens, b""), tokens, b"")


def test_colliding_hash_cannot_reuse_a_block_at_another_position(monkeypatch):
    """With a hash that ignores the parent, [x x] at position 1 looks like [x x] at position 0;
    the parent check keeps it out (its KV was computed at other positions)."""
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens, extra: bytes(tokens))
    bm = BlockManager(8, 2)
    bm.free_seq(computed(bm, [7, 7, 1]))
    hit = bm.match_prefix(make_seq([7, 7, 7, 7, 1]))
    assert len(hit) == 1


def test_caching_off_never_hits():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    bm.free_seq(computed(bm, [1, 2, 3, 4, 5]))
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == []
    assert bm.cached == {}


def test_blocks_holding_nothing_reusable_are_handed_out_first():
    """A freed partial block (no hash) is reused before cached blocks and before never-used ones
    (whose memory has not been touched yet); cached blocks keep their LRU order behind it."""
    bm = BlockManager(8, 2)
    first = computed(bm, [1, 2, 3, 4, 5])  # blocks 0, 1 cached; block 2 holds one token
    bm.free_seq(first)
    taker = make_seq([9, 9])
    assert bm.allocate(taker, 2)
    assert taker.block_table == [2]
    assert len(bm.match_prefix(make_seq([1, 2, 3, 4, 0]))) == 2  # the cached blocks survived
    bm.check_invariants([taker])
    # Without prefix caching every freed block is such a block: a steady load reuses the same few.
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    seq = computed(bm, [1, 2, 3, 4])
    used = set(seq.block_table)
    bm.free_seq(seq)
    again = computed(bm, [5, 6, 7, 8])
    assert set(again.block_table) == used


# -- the sliding-window layers' pool ---------------------------------------------------------------


def test_window_pool_needs_a_window_and_two_blocks():
    for window, window_blocks in ((None, 4), (0, 4), (4, 1)):
        with pytest.raises(ValueError, match="window pool"):
            BlockManager(8, 4, window=window, window_blocks=window_blocks)
    assert BlockManager(8, 4, window=4).window_pool is None  # no blocks: every layer in the one pool


def test_window_blocks_are_released_behind_the_window_and_cached():
    """Window 8, blocks of 4: after 24 computed tokens the next query (position 24) sees 17..24, so
    blocks 0..3 are released (still cached while free); the full-attention table keeps all six."""
    bm = BlockManager(16, 4, window=8, window_blocks=10)
    seq = make_seq(list(range(24)))
    assert bm.allocate(seq, 24)
    assert bm.num_free_window_blocks == 9 - 6
    seq.num_computed_tokens = 24
    bm.commit(seq)
    assert seq.window_block_table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in seq.window_block_table[4:]
    assert bm.num_free_window_blocks == 9 - 2 and len(bm.window_pool.cached) == 6
    assert len(seq.block_table) == 6 and bm.num_free_blocks == 16 - 6
    bm.check_invariants([seq])
    bm.free_seq(seq)
    bm.check_invariants([])
    assert (bm.num_free_blocks, bm.num_free_window_blocks) == (16, 9)


def test_prefix_hit_needs_the_window_pool_to_hold_its_last_window():
    """A 24-token prefix is served whole while the window pool holds its blocks 4 and 5 (the window of
    position 24); once block 5 is gone there, the hit shrinks to the 5 blocks whose own last window
    (blocks 3 and 4) is still held, although the full-attention pool still holds the whole chain."""
    bm = BlockManager(16, 4, window=8, window_blocks=10)
    first = computed(bm, list(range(24)))
    bm.commit(first)
    bm.free_seq(first)
    second = make_seq(list(range(24)) + [99])
    whole = bm.match_prefix(second)
    assert len(whole) == 6 and bm.match_prefix(second, max_blocks=3) == whole[:3]
    del bm.window_pool.cached[first.block_hashes[5]]  # as if evicted
    assert all(h in bm.cached for h in first.block_hashes)
    hit = bm.match_prefix(second)
    assert hit == whole[:5]
    assert bm.allocate(second, 5, hit)
    assert second.window_block_table[:3] == [NULL_BLOCK] * 3
    assert second.window_block_table[3:5] == [bm.window_pool.cached[h] for h in first.block_hashes[3:5]]
    assert second.num_computed_tokens == 20 and len(second.window_block_table) == 7
    bm.check_invariants([second])
