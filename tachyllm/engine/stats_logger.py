"""Periodic one-line engine status for the log, and a one-time hint about a too-large block_size.

The engine calls StatsLogger.maybe_log once per step. At most every `interval_s` seconds it logs
one INFO line: running / waiting sequences, KV usage, prompt and generation throughput since the
previous line, prefix-cache hit rate (hits / queries, in tokens) over the interval and since
start, and preemptions.

Short-shared-prefix heuristic. The prefix cache only reuses whole blocks, so requests that share
a prefix shorter than block_size never hit. To notice this cheaply, the logger keeps the first
block_size tokens ("heads") of the last few fresh requests. When a fresh request gets no cache hit,
its head is compared with those heads: a common prefix of at least half a block (and at least
MIN_SHARED_TOKENS) but less than a whole one means the request shared a prefix the cache could not
use. Once such requests number WARN_AFTER and make up at least half of all zero-hit requests, one
WARNING says so and suggests a smaller block_size. The cost is one comparison of up to block_size
tokens against each remembered head, per new request that missed.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from tachyllm.core.block_manager import BlockManager
from tachyllm.core.scheduler import Scheduler
from tachyllm.core.sequence import Request, Sequence
from tachyllm.outputs import StepStats
from tachyllm.step import StepBatch

logger = logging.getLogger("tachyllm")

MIN_SHARED_TOKENS = 4  # a few shared tokens (a chat header) are not worth caching anyway
WARN_AFTER = 4  # zero-hit requests with a short shared prefix before warning
RECENT_HEADS = 8  # fresh prompts remembered for the comparison


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Totals:
    """Counter values at the previous log line; the next line reports the differences."""

    time: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    queries: int = 0
    hits: int = 0
    preemptions: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0


@dataclass
class StatsLogger:
    block_size: int
    prefix_caching: bool
    interval_s: float = 5.0
    num_prefill_tokens: int = 0  # tokens computed by prefill (and recompute) chunks since start
    warned_short_prefix: bool = False
    _last: _Totals = field(default_factory=lambda: _Totals(time.monotonic()))
    _seen: weakref.WeakSet[Request] = field(default_factory=weakref.WeakSet)
    _heads: deque[list[int]] = field(default_factory=lambda: deque(maxlen=RECENT_HEADS))
    _zero_hit_requests: int = 0
    _short_shared_requests: int = 0

    def maybe_log(
        self,
        stats: StepStats,
        scheduler: Scheduler,
        block_manager: BlockManager,
        batch: StepBatch,
        seqs: list[Sequence],
        now: float | None = None,
    ) -> bool:
        """Accounts for the step that just ran (`batch`, over `seqs`); returns whether a status line was logged."""
        self._count_prefill(batch)
        if self.prefix_caching and not self.warned_short_prefix:
            self._observe_new_requests(seqs)
        now = time.monotonic() if now is None else now
        elapsed = now - self._last.time
        if elapsed < self.interval_s:
            return False
        last = self._last
        queries, hits = stats.prefix_cache_queries - last.queries, stats.prefix_cache_hits - last.hits
        spec = ""
        drafts = stats.spec_num_drafts - last.spec_drafts
        if drafts:
            accepted = stats.spec_num_accepted_tokens - last.spec_accepted
            spec = (
                f", spec decode acceptance {_rate(accepted, stats.spec_num_draft_tokens - last.spec_draft_tokens)}"
                f" mean length {1 + accepted / drafts:.2f} ({drafts} drafts)"
            )
        logger.info(
            "running %d, waiting %d, KV usage %.1f%%, prompt %.1f tok/s, generation %.1f tok/s, "
            "prefix cache hit rate %s (interval) %s (total), preemptions %d (total %d)%s",
            len(scheduler.running), len(scheduler.waiting), 100 * block_manager.usage,
            (self.num_prefill_tokens - last.prompt_tokens) / elapsed,
            (stats.num_generation_tokens - last.generation_tokens) / elapsed,
            _rate(hits, queries), _rate(stats.prefix_cache_hits, stats.prefix_cache_queries),
            stats.num_preemptions - last.preemptions, stats.num_preemptions, spec,
        )  # fmt: skip
        self._last = _Totals(
            now, self.num_prefill_tokens, stats.num_generation_tokens,
            stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions,
            stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
        )  # fmt: skip
        return True

    def _count_prefill(self, batch: StepBatch) -> None:
        """Prefill work = tokens of multi-token chunks, plus single tokens at prompt positions (a
        prompt whose rest after a cache hit is one token). Everything else is a decode."""
        for s in batch.seqs:
            sampling = s.sampling
            if s.num_real_tokens > 1 or not s.completes or (sampling and s.seq_len == sampling.num_prompt_tokens):
                self.num_prefill_tokens += s.num_new_tokens

    def _observe_new_requests(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            req = seq.request
            if req in self._seen:
                continue
            self._seen.add(req)
            head = req.prompt_token_ids[: self.block_size]
            if req.num_cached_tokens == 0:
                self._zero_hit_requests += 1
                # Heads are cut at block_size, so shared == block_size means a whole block was shared
                # (and missed only because its twin was still being computed, not for its size).
                shared = max((_common_prefix_len(head, h) for h in self._heads), default=0)
                if max(MIN_SHARED_TOKENS, self.block_size // 2) <= shared < self.block_size:
                    self._short_shared_requests += 1
            self._heads.append(head)
        if self._short_shared_requests >= WARN_AFTER and 2 * self._short_shared_requests >= self._zero_hit_requests:
            self.warned_short_prefix = True
            logger.warning(
                "prefix caching is on but %d of %d requests without a cache hit shared a prefix shorter "
                "than one block (block_size=%d), which the cache cannot reuse; a smaller block_size "
                "would let them hit", self._short_shared_requests, self._zero_hit_requests, self.block_size,
            )  # fmt: skip


def _rate(hits: int, queries: int) -> str:
    return f"{100 * hits / queries:.1f}%" if queries else "n/a"
