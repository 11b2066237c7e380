"""KV-cache block accounting: allocation, reference counts, and the prefix cache.

Blocks whose reference count drops to zero go to the back of an LRU free list but keep
their content hash, so a later request with the same prefix can take them back; a block
is only forgotten when the free list hands it out for new content (lazy eviction).

A hash only locates a candidate block. A hit also requires the block's tokens to be equal and
its recorded parent to be exactly the block matched one position earlier, so even a colliding
hash cannot hand out KV computed for another prefix or another position.
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

    def identity(self) -> tuple[int, int]:
        """Names this block's current content: a stale parent link (block since reused) never matches."""
        return (self.block_id, self.generation)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, extra_key: bytes = b""):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Anything that changes what a block's KV holds for the same tokens (model, KV dtype) goes here.
        self.extra_key = extra_key
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # With track_cache_events(): hash -> True (entered the cache) / False (left it) since the last
        # drain, the latest change only, so the batch stays bounded however fast blocks churn.
        self._cache_events: dict[bytes, bool] | None = None

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _full_block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Extends seq.block_hashes to cover its first num_full_blocks blocks; hashes depend only on tokens."""
        return extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, num_full_blocks, self.extra_key)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of seq (at most servable_blocks)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = servable_blocks(seq.num_tokens, bs)
        hashes = self._full_block_hashes(seq, max_blocks)
        hit: list[int] = []
        parent = None
        for i in range(max_blocks):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent != parent or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hit.append(block_id)
            parent = block.identity()
        return hit

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        """Makes seq's block table cover num_new_tokens more tokens after its computed ones,
        first adopting prefix_blocks (cache hits, only for an empty table). All or nothing."""
        prefix_blocks = prefix_blocks or []
        assert not prefix_blocks or not seq.block_table
        bs = self.block_size
        total_tokens = seq.num_computed_tokens + len(prefix_blocks) * bs + num_new_tokens
        num_new_blocks = cdiv(total_tokens, bs) - len(seq.block_table) - len(prefix_blocks)
        # Prefix blocks sitting in the free list are taken out of it, so they are not available twice.
        num_revived = sum(1 for b in prefix_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > len(self.free) - num_revived:
            return False
        for block_id in prefix_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens += len(prefix_blocks) * bs
        seq.num_cached_blocks += len(prefix_blocks)  # the table was empty: these are its first blocks
        for _ in range(max(num_new_blocks, 0)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict: this block's old content is about to be overwritten
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                    if self._cache_events is not None:
                        self._cache_events[block.hash] = False
                block.hash = None
                block.token_ids = None
                block.parent = None
            block.generation += 1
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Drops seq's references. Tail blocks are released first so that they are also evicted
        first: a prefix's head is shared more often than its tail. Blocks that hold nothing
        reusable (no hash) go to the front, to be handed out before any cached block and before
        never-used ones: on a VM, the first write to never-touched cache memory is far slower than
        a write to touched memory (measurements: docs/design_measurements.md#block-reuse-order)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Releases the blocks past the first num_tokens positions of seq (they held the KV of rejected
        draft tokens). Such blocks were allocated to seq alone and never registered in the cache."""
        keep = max(cdiv(num_tokens, self.block_size), seq.num_cached_blocks)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None, f"trimmed block {block.block_id} is shared"
            block.ref_count = 0
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)  # holds nothing reusable

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
            block = self.blocks[seq.block_table[i]]
            parent = self.blocks[seq.block_table[i - 1]].identity() if i else None
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            twin_id = self.cached.get(hashes[i])
            if twin_id is not None:
                twin = self.blocks[twin_id]
                if twin.token_ids == tokens and twin.parent == parent:
                    # Another sequence computed the same block (e.g. both prefilled one system prompt
                    # in the same step): share its copy, so that our next blocks chain to it.
                    self._replace_block(seq, i, twin)
                    continue
                # Otherwise the entry is stale (its parent was evicted) or a true collision: ours wins.
            block.hash, block.token_ids, block.parent = hashes[i], tokens, parent
            self.cached[hashes[i]] = block.block_id
            if self._cache_events is not None:
                self._cache_events[hashes[i]] = True
        seq.num_cached_blocks = num_full

    def track_cache_events(self) -> list[bytes]:
        """Starts recording which block hashes enter and leave the prefix cache (for a router that
        sends requests where their prefix is cached); returns the hashes cached now."""
        self._cache_events = {}
        return list(self.cached)

    def drain_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, evicted) block hashes since the last drain: each hash in one list at most, as it is now."""
        if self._cache_events is None:
            return [], []
        events, self._cache_events = self._cache_events, {}
        return [h for h, stored in events.items() if stored], [h for h, stored in events.items() if not stored]

    def _replace_block(self, seq: Sequence, index: int, twin: Block) -> None:
        """Points seq.block_table[index] at twin, which holds identical KV, and releases seq's own copy."""
        if twin.ref_count == 0:
            del self.free[twin.block_id]
        twin.ref_count += 1
        own = self.blocks[seq.block_table[index]]
        seq.block_table[index] = twin.block_id
        own.ref_count -= 1
        if own.ref_count == 0:
            # It holds nothing anyone can look up, so it is the first block worth handing out.
            self.free[own.block_id] = None
            self.free.move_to_end(own.block_id, last=False)

    # -- testing aid -----------------------------------------------------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Every block is free xor referenced, ref counts equal the block tables holding them, and the
        registered blocks of each table hold exactly that sequence's prefix, chained in order."""
        counts = [0] * self.num_blocks
        bs = self.block_size
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq.seq_id} holds a block twice"
            assert len(seq.block_table) * bs >= seq.num_computed_tokens, f"seq {seq.seq_id} computed past its table"
            for block_id in seq.block_table:
                counts[block_id] += 1
            for i in range(seq.num_cached_blocks):
                block = self.blocks[seq.block_table[i]]
                assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs]), (
                    f"seq {seq.seq_id} block {i} (id {block.block_id}) holds other tokens"
                )
                parent = self.blocks[seq.block_table[i - 1]].identity() if i else None
                assert block.parent == parent, f"seq {seq.seq_id} block {i} is chained to another prefix"
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]} tables"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free), f"block {block.block_id} free-list mismatch"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h, f"cache map points at block {block_id} with another hash"
