"""KV-cache block accounting: allocation, reference counts, and the prefix cache.

Blocks whose reference count drops to zero go to the back of an LRU free list but keep
their content hash, so a later request with the same prefix can take them back; a block
is only forgotten when the free list hands it out for new content (lazy eviction).

A hash only locates a candidate block. A hit also requires the block's tokens to be equal and
its recorded parent to be exactly the block matched one position earlier, so even a colliding
hash cannot hand out KV computed for another prefix or another position.

A model with sliding-window layers (Gemma 3's local layers) gives them a pool and a block table of
their own (vLLM's hybrid KV-cache groups): the two tables have the same length, but the window
table's blocks that every later query of the sequence sees past (wholly before its window) are
released as the sequence advances, their entries left as NULL_BLOCK, which the attention kernels
never read. A prefix-cache hit then also needs the window pool to still hold the blocks the
prefix's last window covers; each such block is linked to the full-attention block computed with
it at the same position, which the hit has already verified, so collisions stay harmless there too.
Cache events (track_cache_events) are the full-attention pool's: the prefix chain a router follows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tachyllm.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...], extra_key: bytes) -> bytes:
    """Content hash of one full block, chained to its parent so it identifies the whole prefix.
    SHA-256 makes collisions practically impossible; lookups also compare tokens."""
    h = hashlib.sha256(parent or b"\0")
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: list[int], block_size: int, num_blocks: int, extra_key: bytes
) -> list[bytes]:
    """Extends `hashes` (the chain of the first len(hashes) blocks of token_ids) to its first num_blocks
    blocks, in place; a router computes a prompt's chain with it exactly as the block manager does."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key))
    return hashes


def servable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a prefix-cache hit may cover: at least one token is left to compute (the last
    position's logits are needed to sample)."""
    return (num_tokens - 1) // block_size


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens, kept to verify prefix hits
    # identity() of the cached block holding the previous block of the same prefix; None for a
    # first block. Verified on lookup together with token_ids.
    parent: tuple[int, int] | None = None
    generation: int = 0  # bumped each time the block is handed out for new content
    # In the window pool, `parent` is instead the identity() of the full-attention block at the same
    # position of the sequence that computed this block.

    def identity(self) -> tuple[int, int]:
        """Names this block's current content: a stale parent link (block since reused) never matches."""
        return (self.block_id, self.generation)


# The window pool's block 0: the entry of a released window block. Never handed out; kernels never read it.
NULL_BLOCK = 0


class BlockPool:
    """One pool of KV blocks: reference counts, the LRU free list (lazy eviction: see the module
    docstring) and the prefix-cache map."""

    def __init__(self, num_blocks: int, reserved: int = 0):
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The first `reserved` blocks are never handed out (the sliding-window pool's placeholder).
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(reserved, num_blocks))
        self.cached: dict[bytes, int] = {}
        # With BlockManager.track_cache_events(): hash -> True (entered the cache) / False (left it)
        # since the last drain, the latest change only, so the batch stays bounded however fast blocks churn.
        self.events: dict[bytes, bool] | None = None

    def take(self) -> int:
        """A free block for new content (its old content, if cached, is evicted), held once."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events[block.hash] = False
            block.hash = None
            block.token_ids = None
            block.parent = None
        block.generation += 1
        block.ref_count = 1
        return block_id

    def hold(self, block_id: int) -> None:
        """One more reference to a block (a prefix hit), taking it out of the free list if it sat there."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drops a reference. A block that holds nothing reusable (no hash) goes to the front of the
        free list, to be handed out before any cached block and before never-used ones: on a VM, the
        first write to never-touched cache memory is far slower than a write to touched memory
        (measurements: docs/design_measurements.md#block-reuse-order)."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)

    def register(
        self, block: Block, block_hash: bytes, token_ids: tuple[int, ...], parent: tuple[int, int] | None
    ) -> None:
        block.hash, block.token_ids, block.parent = block_hash, token_ids, parent
        self.cached[block_hash] = block.block_id
        if self.events is not None:
            self.events[block_hash] = True

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...], parent: tuple[int, int] | None) -> Block | None:
        """The cached block with this hash, if it holds these tokens and is linked to `parent`."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.parent == parent and block.token_ids == token_ids else None

    def check_counts(self, tables: list[list[int]], reserved: int = 0) -> None:
        """Ref counts equal the tables holding each block; every block is free xor referenced."""
        counts = [0] * len(self.blocks)
        for table in tables:
            for block_id in table:
                counts[block_id] += 1
        for block in self.blocks[reserved:]:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]} tables"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free), f"block {block.block_id} free-list mismatch"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h, f"cache map points at block {block_id} with another hash"


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_key: bytes = b"",
        window: int | None = None,
        window_blocks: int = 0,
    ):
        """num_blocks: the full-attention pool (every layer's, without a window pool). With a
        `window` and `window_blocks` (NULL_BLOCK included), the sliding-window layers' own pool."""
        if window_blocks and not (window is not None and window >= 1 and window_blocks >= 2):
            raise ValueError(f"a window pool needs window >= 1 and >= 2 blocks, got {window!r} and {window_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Anything that changes what a block's KV holds for the same tokens (model, KV dtype) goes here.
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks)
        self.window = window if window_blocks else None
        self.window_pool = BlockPool(window_blocks, reserved=1) if window_blocks else None

    # -- queries ---------------------------------------------------------------------------
    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def free(self) -> OrderedDict[int, None]:
        return self.pool.free

    @property
    def cached(self) -> dict[bytes, int]:
        return self.pool.cached

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    @property
    def num_window_blocks(self) -> int:
        """Blocks the window pool can hand out (NULL_BLOCK excluded); 0 without one."""
        return len(self.window_pool.blocks) - 1 if self.window_pool else 0

    @property
    def num_free_window_blocks(self) -> int:
        return len(self.window_pool.free) if self.window_pool else 0

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached-but-free blocks count as free), of
        the fuller pool."""
        usage = 1.0 - len(self.pool.free) / self.num_blocks
        if self.window_pool:
            usage = max(usage, 1.0 - self.num_free_window_blocks / self.num_window_blocks)
        return usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _full_block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Extends seq.block_hashes to cover its first num_full_blocks blocks; hashes depend only on tokens
        (and on the LoRA adapter the request runs with)."""
        extra_key = self.extra_key + seq.request.lora_digest
        return extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, num_full_blocks, extra_key)

    def _window_start(self, position: int) -> int:
        """The first block that a query at `position` or later reads in a sliding-window layer."""
        assert self.window is not None, "only a manager with a window pool has window layers"
        return max(0, position - self.window + 1) // self.block_size

    def match_prefix(self, seq: Sequence, max_blocks: int | None = None) -> list[int]:
        """Cached blocks holding the longest prefix of seq (at most servable_blocks, and max_blocks)
        whose last window the window pool also still holds."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = min(servable_blocks(seq.num_tokens, bs), max_blocks if max_blocks is not None else seq.num_tokens)
        hashes = self._full_block_hashes(seq, max_blocks)
        hit: list[int] = []
        parent = None
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs]), parent)
            if block is None:
                break
            hit.append(block.block_id)
            parent = block.identity()
        if self.window_pool is None:
            return hit
        # run[k]: how many window blocks right before block k are cached; a k-block hit needs those from
        # _window_start(k * bs) on.
        run = [0]
        for i in range(len(hit)):
            run.append(run[-1] + 1 if self._window_lookup(seq, hit, i) is not None else 0)
        k = len(hit)
        while k and run[k] < k - self._window_start(k * bs):
            k -= 1
        return hit[:k]

    def _window_lookup(self, seq: Sequence, hit: list[int], i: int) -> int | None:
        """The window pool's cached block i of seq's prefix, computed with the full-attention block hit[i]."""
        bs = self.block_size
        tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
        assert self.window_pool is not None, "only a manager with a window pool looks up window blocks"
        block = self.window_pool.lookup(seq.block_hashes[i], tokens, self.pool.blocks[hit[i]].identity())
        return None if block is None else block.block_id

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        """Makes seq's block tables cover num_new_tokens more tokens after its computed ones,
        first adopting prefix_blocks (cache hits from match_prefix, only for empty tables). All or nothing."""
        if prefix_blocks:
            return self._allocate_after_prefix(seq, num_new_tokens, prefix_blocks)
        num_new_blocks = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if num_new_blocks <= 0:  # a decode inside its last block: the common case, kept short
            return True
        window_pool = self.window_pool
        if num_new_blocks > len(self.pool.free) or (window_pool and num_new_blocks > len(window_pool.free)):
            return False
        for _ in range(num_new_blocks):
            seq.block_table.append(self.pool.take())
            if window_pool:
                seq.window_block_table.append(window_pool.take())
        return True

    def _allocate_after_prefix(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int]) -> bool:
        assert not seq.block_table
        bs = self.block_size
        num_new_blocks = cdiv(seq.num_computed_tokens + len(prefix_blocks) * bs + num_new_tokens, bs) - len(
            prefix_blocks
        )
        window_prefix: list[int] = []
        if self.window_pool:
            # The prefix's blocks before its last window are not held: their entries are NULL_BLOCK.
            first = self._window_start(len(prefix_blocks) * bs)
            held = [self._window_lookup(seq, prefix_blocks, i) for i in range(first, len(prefix_blocks))]
            window_prefix = [NULL_BLOCK] * first + [block_id for block_id in held if block_id is not None]
            assert len(window_prefix) == len(prefix_blocks), "prefix_blocks is not a match_prefix hit"
            if not _has_room(self.window_pool, window_prefix[first:], num_new_blocks):
                return False
        if not _has_room(self.pool, prefix_blocks, num_new_blocks):
            return False
        for block_id in prefix_blocks:
            self.pool.hold(block_id)
        seq.block_table += prefix_blocks
        seq.num_computed_tokens += len(prefix_blocks) * bs
        seq.num_cached_blocks += len(prefix_blocks)  # the table was empty: these are its first blocks
        seq.block_table += [self.pool.take() for _ in range(num_new_blocks)]
        if self.window_pool:
            for block_id in window_prefix:
                if block_id != NULL_BLOCK:
                    self.window_pool.hold(block_id)
            seq.window_block_table += window_prefix
            seq.window_block_table += [self.window_pool.take() for _ in range(num_new_blocks)]
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Drops seq's references. Tail blocks are released first so that they are also evicted
        first: a prefix's head is shared more often than its tail."""
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        for block_id in reversed(seq.window_block_table):
            if block_id != NULL_BLOCK:
                assert self.window_pool is not None, "a window block table's blocks come from the window pool"
                self.window_pool.release(block_id)
        seq.block_table = []
        seq.window_block_table = []
        seq.num_cached_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Releases the blocks past the first num_tokens positions of seq (they held the KV of rejected
        draft tokens). Such blocks were allocated to seq alone and never registered in the cache."""
        keep = max(cdiv(num_tokens, self.block_size), seq.num_cached_blocks)
        for pool, table in ((self.pool, seq.block_table), (self.window_pool, seq.window_block_table)):
            while len(table) > keep:
                assert pool is not None, "a window block table's blocks come from the window pool"
                block = pool.blocks[table.pop()]
                assert block.ref_count == 1 and block.hash is None, f"trimmed block {block.block_id} is shared"
                pool.release(block.block_id)

    def commit(self, seq: Sequence) -> None:
        """After seq's computed tokens grew: registers the blocks it filled (cache_full_blocks), then
        releases the window blocks that no later query of seq reads (they stay cached while free)."""
        if self.enable_prefix_caching and seq.num_computed_tokens // self.block_size > seq.num_cached_blocks:
            self.cache_full_blocks(seq)
        if self.window_pool is None:
            return
        table = seq.window_block_table
        end = self._window_start(seq.num_computed_tokens)
        start = end
        while start and table[start - 1] != NULL_BLOCK:
            start -= 1
        for i in range(start, end):  # oldest first, so that it is also evicted first
            self.window_pool.release(table[i])
            table[i] = NULL_BLOCK

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers blocks that the last step filled completely, so other requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._full_block_hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            # Blocks past num_cached_blocks were allocated to seq alone and are not registered yet.
            parent = self.pool.blocks[seq.block_table[i - 1]].identity() if i else None
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            twin = self.pool.lookup(hashes[i], tokens, parent)
            if twin is not None:
                # Another sequence computed the same block (e.g. both prefilled one system prompt
                # in the same step): share its copy, so that our next blocks chain to it.
                self._replace_block(seq, i, twin)
            else:
                # A stale entry (its parent was evicted) or a true collision: ours wins.
                self.pool.register(self.pool.blocks[seq.block_table[i]], hashes[i], tokens, parent)
            if self.window_pool:
                window_block = self.window_pool.blocks[seq.window_block_table[i]]
                own = self.pool.blocks[seq.block_table[i]].identity()
                self.window_pool.register(window_block, hashes[i], tokens, own)
        seq.num_cached_blocks = num_full

    def track_cache_events(self) -> list[bytes]:
        """Starts recording which block hashes enter and leave the prefix cache (for a router that
        sends requests where their prefix is cached); returns the hashes cached now."""
        self.pool.events = {}
        return list(self.pool.cached)

    def drain_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, evicted) block hashes since the last drain: each hash in one list at most, as it is now."""
        if self.pool.events is None:
            return [], []
        events, self.pool.events = self.pool.events, {}
        return [h for h, stored in events.items() if stored], [h for h, stored in events.items() if not stored]

    def _replace_block(self, seq: Sequence, index: int, twin: Block) -> None:
        """Points seq.block_table[index] at twin, which holds identical KV, and releases seq's own copy
        (it holds nothing anyone can look up, so it is the first block worth handing out)."""
        self.pool.hold(twin.block_id)
        own = seq.block_table[index]
        seq.block_table[index] = twin.block_id
        self.pool.release(own)

    # -- testing aid -----------------------------------------------------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Every block of both pools is free xor referenced, ref counts equal the block tables holding
        them, the registered blocks of each table hold exactly that sequence's prefix, chained in
        order, and a window table matches its full-attention table, released entries leading."""
        bs = self.block_size
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq.seq_id} holds a block twice"
            assert len(seq.block_table) * bs >= seq.num_computed_tokens, f"seq {seq.seq_id} computed past its table"
            for i in range(seq.num_cached_blocks):
                block = self.pool.blocks[seq.block_table[i]]
                assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs]), (
                    f"seq {seq.seq_id} block {i} (id {block.block_id}) holds other tokens"
                )
                parent = self.pool.blocks[seq.block_table[i - 1]].identity() if i else None
                assert block.parent == parent, f"seq {seq.seq_id} block {i} is chained to another prefix"
        self.pool.check_counts([seq.block_table for seq in live_seqs])
        if self.window_pool is None:
            assert not any(seq.window_block_table for seq in live_seqs), "a window table without a window pool"
            return
        held = []
        for seq in live_seqs:
            table = seq.window_block_table
            assert len(table) == len(seq.block_table), f"seq {seq.seq_id}: window table of another length"
            released = len(table) - len([b for b in table if b != NULL_BLOCK])
            assert table[released:].count(NULL_BLOCK) == 0, f"seq {seq.seq_id}: a window block released mid-table"
            assert released <= self._window_start(seq.num_computed_tokens), f"seq {seq.seq_id} released a read block"
            held.append(table[released:])
            for i in range(released, seq.num_cached_blocks):
                block = self.window_pool.blocks[table[i]]
                assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs]), (
                    f"seq {seq.seq_id} window block {i} (id {block.block_id}) holds other tokens"
                )
                assert block.parent == self.pool.blocks[seq.block_table[i]].identity(), (
                    f"seq {seq.seq_id} window block {i} is linked to another block"
                )
        self.window_pool.check_counts(held, reserved=1)


def _has_room(pool: BlockPool, prefix_blocks: list[int], num_new_blocks: int) -> bool:
    """Whether the pool can adopt prefix_blocks and hand out num_new_blocks: prefix blocks sitting in
    the free list are taken out of it, so they are not available twice."""
    num_revived = sum(1 for b in prefix_blocks if pool.blocks[b].ref_count == 0)
    return num_new_blocks <= len(pool.free) - num_revived
