"""Which engine replica holds which KV blocks, and where a request should go because of it.

Replicas report the chained block hashes their prefix cache stores and evicts (the hashes of
core/block_manager.py, the same ones a replica looks its cache up by), so the index knows exactly,
not by approximating prompts' characters, how long a prefix of a request's blocks each replica
holds. A chained hash names its whole prefix, so "holds block i" means "holds KV for the first
i + 1 blocks' tokens" as long as the replica still holds the earlier ones; the walk below stops
at the first block a replica lacks.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

PREFIX_HIT = "prefix_hit"  # a replica holding part of the prompt: the least work ahead of its first token
LOAD_FALLBACK = "load_fallback"  # the holders were too busy: a replica without the prefix, or the load guard
NO_MATCH = "no_match"  # no replica holds the first block: the least work ahead, under the load guard
DECISIONS = (PREFIX_HIT, LOAD_FALLBACK, NO_MATCH)
# What a replica that has to load a request's LoRA adapter first is charged, in prompt blocks of work:
# a tie-breaker that sends an adapter's requests to a replica that has it loaded when their prefix
# work is otherwise equal (no prefix held, say), and lets a longer held prefix still win. An
# adapter's blocks are its own (their hashes include its content digest), so holding its prefix
# implies having run it.
ADAPTER_LOAD_BLOCKS = 1


def adapter_marker(digest: bytes) -> bytes:
    """The entry a replica publishes among its cached blocks while it has the LoRA adapter of content
    `digest` loaded (never a block hash: those chain a block's tokens)."""
    return hashlib.sha256(b"tachyllm lora adapter loaded\0" + digest).digest()


class PrefixIndex:
    """Block hash -> the replicas holding it, and replica -> its blocks (to forget a replica at once)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        """Entries in the index: one per (replica, block) pair."""
        return sum(len(blocks) for blocks in self._blocks.values())

    def apply(self, replica: str, stored: Iterable[bytes] = (), evicted: Iterable[bytes] = ()) -> None:
        """One batch of a replica's cache events, in order: stored, then evicted."""
        blocks = self._blocks.setdefault(replica, set())
        for h in stored:
            blocks.add(h)
            self._holders.setdefault(h, set()).add(replica)
        for h in evicted:
            blocks.discard(h)
            self._drop_holder(h, replica)

    def reset(self, replica: str, blocks: Iterable[bytes]) -> None:
        """Replaces what the index knows of a replica with a full list of its cached blocks."""
        self.forget(replica)
        self.apply(replica, stored=blocks)

    def forget(self, replica: str) -> None:
        """A replica died or left: none of its blocks can be used any more."""
        for h in self._blocks.pop(replica, ()):
            self._drop_holder(h, replica)

    def _drop_holder(self, h: bytes, replica: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[h]

    def replicas(self) -> list[str]:
        return list(self._blocks)

    def holders(self, h: bytes) -> set[str]:
        return set(self._holders.get(h, ()))

    def matched_blocks(self, hashes: list[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """For each of `replicas`, how many of `hashes` (a prompt's blocks, in order) it holds from the start."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(matched)
        for i, h in enumerate(hashes):
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] = i + 1
        return matched


@dataclass(frozen=True)
class RoutingDecision:
    replica: str
    reason: str  # one of DECISIONS
    matched_blocks: int  # of the chosen replica
    prompt_blocks: int  # the prompt's cacheable blocks


def choose_replica(
    matched: dict[str, int],
    queue_lengths: dict[str, int],
    load_margin: int,
    prompt_blocks: int,
    pending_blocks: dict[str, int],
    rng: random.Random | None = None,
    without_adapter: AbstractSet[str] = frozenset(),
) -> RoutingDecision:
    """The replica with the least work ahead of the request's first token, counted in blocks: the
    prompt blocks it lacks, plus the prompt blocks that requests already sent to it have still to
    compute (`pending_blocks`, ray_serve/pending_prefill.py). A long held prefix outweighs another
    request's prefill ahead of it (a conversation's next turn stays with its history); one shared
    block of a chat template does not (new chats go where no prompt is being computed). Equal work:
    the shorter queue, then any.

    The load guard: a chosen replica whose queue is longer than the shortest by more than
    `load_margin` requests is passed over for the less loaded of two other replicas drawn at random
    (power of two choices), so that a hot prefix spreads out.

    A request for a LoRA adapter costs the replicas that do not have it loaded (`without_adapter`)
    ADAPTER_LOAD_BLOCKS more.

    `matched`, `queue_lengths` and `pending_blocks` have the same keys: the replicas that can take the
    request."""
    if not matched:
        raise ValueError("no replica to choose from")
    sample = (rng or random).sample
    shortest = min(queue_lengths.values())
    any_match = max(matched.values()) > 0
    work = {
        r: prompt_blocks - matched[r] + pending_blocks[r] + (ADAPTER_LOAD_BLOCKS if r in without_adapter else 0)
        for r in matched
    }
    least = min(work.values())
    # A fixed order would pile ties on one replica.
    tied = [r for r in sorted(matched) if work[r] == least]
    best = min(sample(tied, len(tied)), key=lambda r: queue_lengths[r])
    if queue_lengths[best] <= shortest + load_margin:
        reason = NO_MATCH if not any_match else PREFIX_HIT if matched[best] > 0 else LOAD_FALLBACK
        return RoutingDecision(best, reason, matched[best], prompt_blocks)
    others = [r for r in sorted(matched) if r != best]  # too busy: never drawn below
    chosen = min(sample(others, min(2, len(others))), key=lambda r: queue_lengths[r])
    return RoutingDecision(chosen, LOAD_FALLBACK if any_match else NO_MATCH, matched[chosen], prompt_blocks)
