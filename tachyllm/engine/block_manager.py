"""KV-cache block accounting: allocation, reference counts, and the prefix cache.

Blocks whose reference count drops to zero go to the back of an LRU free list but keep
their content hash, so a later request with the same prefix can take them back; a block
is only forgotten when the free list hands it out for new content (lazy eviction).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tachyllm.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes | None, token_ids: list[int] | tuple[int, ...], extra_key: bytes) -> bytes:
    """Content hash of one full block, chained to its parent so it identifies the whole prefix.
    SHA-256 makes collisions practically impossible; lookups also compare tokens."""
    h = hashlib.sha256(parent or b"\0")
    h.update(extra_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the block's tokens, kept to verify prefix hits


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
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], self.extra_key))
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of seq, leaving at least one token to compute
        (the last position's logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self._full_block_hashes(seq, max_blocks)
        hit: list[int] = []
        for i in range(max_blocks):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hit.append(block_id)
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
        seq.num_cached_blocks = len(prefix_blocks)
        for _ in range(max(num_new_blocks, 0)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict: this block's old content is about to be overwritten
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash = None
                block.token_ids = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Drops seq's references. Tail blocks are released first so that they are also evicted
        first: a prefix's head is shared more often than its tail."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_cached_blocks = 0

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
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached:
                block.hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.cached[hashes[i]] = block.block_id
        seq.num_cached_blocks = num_full

    # -- testing aid -----------------------------------------------------------------------
    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Every block is free xor referenced, and ref counts equal the block tables holding them."""
        counts = [0] * self.num_blocks
        for seq in live_seqs:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]} tables"
            )
            assert (block.ref_count == 0) == (block.block_id in self.free), f"block {block.block_id} free-list mismatch"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h, f"cache map points at block {block_id} with another hash"
