"""Decides, each step, how many new tokens every sequence computes.

Prefill chunks, prefix-cache hits and decodes all reduce to one number per sequence under a
token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running decodes are
served first, then running prefills, then waiting sequences. When the cache runs out of blocks,
the lowest-priority / latest-arrived running sequence is preempted: its blocks are freed and it
is recomputed later from its prompt plus the tokens it had generated.

With `max_decode_slowdown`, a step that carries decodes takes only as many prefill tokens as keep
its predicted time within that factor of the decodes' own step (step_cost.py): long prompts then
arrive over more, smaller chunks while the running streams keep their pace.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tachyllm.engine.block_manager import BlockManager
from tachyllm.engine.sequence import Sequence, SequenceStatus
from tachyllm.engine.step_cost import StepCostModel, StepShape
from tachyllm.outputs import StepStats


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens in this step's forward, draft tokens included
    # Draft tokens verified this step after the sequence's last token (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_real_tokens(self) -> int:
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def completes(self) -> bool:
        """After this step every token of the sequence has KV, so its last position is sampled."""
        return self.seq.num_computed_tokens + self.num_real_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def shape(self) -> StepShape:
        """What the step's cost depends on (engine/step_cost.py)."""
        return sum((StepShape.of(s.seq.num_computed_tokens, s.num_new_tokens) for s in self.scheduled), StepShape())


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        stats: StepStats,
        max_decode_slowdown: float | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.stats = stats
        self.max_decode_slowdown = max_decode_slowdown if enable_chunked_prefill else None
        self.step_cost = StepCostModel()
        self.waiting: list[Sequence] = []  # kept sorted by arrival_order
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival_order)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Decodes (one uncomputed token) first so that prefill chunks never delay a token stream.
        self.running.sort(key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival_order))
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = self._prefill_cap(seq, min(seq.num_uncomputed_tokens, budget), out)
            spec = self._fit_spec_tokens(seq, budget)
            if spec:
                if self.block_manager.allocate(seq, 1 + len(spec)):
                    out.scheduled.append(ScheduledSeq(seq, 1 + len(spec), spec))
                    budget -= 1 + len(spec)
                    continue
                seq.clear_spec()  # no room for the drafts: decode one token, preempting if need be
            while not self.block_manager.allocate(seq, num_new):
                # The victim is the lowest-priority, latest-arrived running sequence, even one already
                # scheduled this step: decodes go first, so they may be junior to this prefill chunk.
                victim = max(self.running, key=lambda s: s.arrival_order)
                if victim in queue:
                    queue.remove(victim)
                elif victim is not seq:
                    dropped = next(s for s in out.scheduled if s.seq is victim)
                    out.scheduled.remove(dropped)
                    budget += dropped.num_new_tokens
                self._preempt(victim)
                victim.clear_spec()
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new

        # New sequences join only when nobody had to be preempted: otherwise they would take the
        # blocks that the preempted ones need to resume.
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.block_manager.match_prefix(seq)
            num_new = seq.num_tokens - len(prefix) * self.block_manager.block_size
            # Without chunked prefill a prompt goes in one step; only a preempted sequence whose prompt
            # plus output outgrew the whole budget is recomputed in chunks, or it could never resume.
            can_chunk = self.enable_chunked_prefill or num_new > self.max_num_batched_tokens
            if num_new > budget and not can_chunk:
                break
            num_new = min(num_new, budget)
            if can_chunk:
                num_new = self._prefill_cap(seq, num_new, out, len(prefix) * self.block_manager.block_size)
            if not self.block_manager.allocate(seq, num_new, prefix):
                break
            self.waiting.pop(0)
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += len(prefix) * self.block_manager.block_size
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.num_cached_tokens = len(prefix) * self.block_manager.block_size
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The wall time of the step `out` described, for the chunk-size model."""
        if self.max_decode_slowdown is not None:
            self.step_cost.observe(out.shape, seconds)

    def _prefill_cap(self, seq: Sequence, num_new: int, out: SchedulerOutput, start: int | None = None) -> int:
        """num_new, or fewer prefill tokens if the step would otherwise slow its decodes beyond
        max_decode_slowdown (at least one token, so that the prompt always advances)."""
        if self.max_decode_slowdown is None or num_new <= 1:
            return num_new
        decodes = [s for s in out.scheduled if s.num_real_tokens == 1 and s.completes]
        if not decodes:
            return num_new
        cost = self.step_cost
        alone = cost.predict(SchedulerOutput(decodes).shape)
        if alone is None:
            return num_new
        limit = self.max_decode_slowdown * alone
        shape = out.shape
        start = seq.num_computed_tokens if start is None else start

        def fits(n: int) -> bool:
            return cost.predict(shape + StepShape.of(start, n)) <= limit

        if fits(num_new):
            return num_new
        low, high = 1, num_new  # the predicted time grows with n: the largest n that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low

    def _fit_spec_tokens(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens of a decoding sequence that fit the token budget next to its own token."""
        if not seq.spec_token_ids or seq.num_uncomputed_tokens != 1:
            return []
        room = budget - 1
        if room < len(seq.spec_token_ids):
            seq.spec_token_ids = seq.spec_token_ids[:room]
            if seq.spec_draft_probs is not None:
                seq.spec_draft_probs = seq.spec_draft_probs[:room]
        return seq.spec_token_ids

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.num_computed_tokens = 0
        self.running.remove(seq)
        self.add(seq)
        self.stats.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Ends seq wherever it is (waiting or running) and returns its blocks at once."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.stats.finished_reasons[reason] = self.stats.finished_reasons.get(reason, 0) + 1
