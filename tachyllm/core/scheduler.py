"""Decides, each step, how many new tokens every sequence computes.

Prefill chunks, prefix-cache hits and decodes all reduce to one number per sequence under a
token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running decodes are
served first, then running prefills, then waiting sequences. When the cache runs out of blocks,
the lowest-priority / latest-arrived running sequence is preempted: its blocks are freed and it
is recomputed later from its prompt plus the tokens it had generated.

With `max_decode_slowdown`, a step that carries decodes takes only as many prefill tokens as keep
its predicted time within that factor of the decodes' own step (step_cost.py): long prompts then
arrive over more, smaller chunks while the running streams keep their pace.

The step is handed to the runner as plain data (a StepBatch); the runner's StepResult comes back to
`update_from_output`, the one place that applies a step: computed-token counts, full blocks entering
the prefix cache, sampled tokens, rejected draft slots released, sequences finished.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from tachyllm.config import SchedulerConfig
from tachyllm.core.block_manager import BlockManager
from tachyllm.core.sequence import Sequence, SequenceStatus
from tachyllm.core.step_cost import StepCostModel, StepShape
from tachyllm.outputs import StepStats
from tachyllm.step import LogprobInfo, PromptLogprobsInput, SamplingInput, ScheduledSeq, StepBatch, StepResult
from tachyllm.structured_output.grammar import BitmaskFiller


@dataclass
class _Planned:
    """A sequence's share of the step being planned (the scheduler's own view, with the Sequence)."""

    seq: Sequence
    num_new_tokens: int  # tokens in this step's forward, draft tokens included
    # Draft tokens verified this step after the sequence's last token (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)
    # The first of them its grammar allows: all but a last refused one kept for a sampled draft
    # model (_fit_spec_tokens).
    num_valid_drafts: int = 0

    @property
    def num_real_tokens(self) -> int:
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def completes(self) -> bool:
        """After this step every token of the sequence has KV, so its last position is sampled."""
        return self.seq.num_computed_tokens + self.num_real_tokens == self.seq.num_tokens


@dataclass
class _Plan:
    scheduled: list[_Planned] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def shape(self) -> StepShape:
        """What the step's cost depends on (core/step_cost.py)."""
        return sum((StepShape.of(s.seq.num_computed_tokens, s.num_new_tokens) for s in self.scheduled), StepShape())


@dataclass
class SeqUpdate:
    """What one sequence gained in a step, for the output processor (engine/output_processor.py)."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[LogprobInfo | None]


def _prompt_logprobs_input(seq: Sequence, start: int, num_real: int) -> PromptLogprobsInput | None:
    """The rows of this step (positions start .. start + num_real - 1) that score a prompt token whose
    logprob is not known yet: every prompt position but the last predicts the next prompt token."""
    if not seq.needs_prompt_logprobs:
        return None
    assert seq.params.prompt_logprobs is not None, "needs_prompt_logprobs checked it"
    first = max(start, len(seq.request.prompt_logprobs))
    end = min(start + num_real, seq.num_prompt_tokens - 1)
    if first >= end:
        return None
    return PromptLogprobsInput(seq.params.prompt_logprobs, first - start, seq.token_ids[first + 1 : end + 1])


def step_shape(batch: StepBatch) -> StepShape:
    """What a step's cost depends on (core/step_cost.py)."""
    return sum((StepShape.of(s.start, s.num_new_tokens) for s in batch.seqs), StepShape())


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        config: SchedulerConfig,
        stats: StepStats,
        eos_token_ids: list[int] | None = None,
        max_model_len: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.stats = stats
        self.max_decode_slowdown = config.max_decode_slowdown if config.enable_chunked_prefill else None
        self.step_cost = StepCostModel(linear_fit=self.max_decode_slowdown is not None)
        self.eos_token_ids = eos_token_ids or []
        self.max_model_len = max_model_len
        self.max_loras = config.max_loras  # distinct LoRA adapters in one step (None: no adapters served)
        self.waiting: list[Sequence] = []  # kept sorted by arrival_order
        self.running: list[Sequence] = []
        # The sequences of the batch in flight, by seq id, and those that ended since the last batch.
        self._in_flight: dict[int, Sequence] = {}
        self._ended_seq_ids: list[int] = []
        self._bitmasks: BitmaskFiller | None = None  # made for the first constrained sequence

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival_order)

    def schedule(self) -> StepBatch:
        """The next step: how many new tokens each sequence computes, as plain data for the runner."""
        plan = self._plan()
        return self._batch(plan)

    def _plan(self) -> _Plan:
        out = _Plan()
        budget = self.max_num_batched_tokens
        # Decodes (one uncomputed token) first so that prefill chunks never delay a token stream.
        self.running.sort(key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival_order))
        queue = deque(self.running)
        while queue and budget > 0:
            seq = queue.popleft()
            num_new = self._prefill_cap(seq, min(seq.num_uncomputed_tokens, budget), out)
            spec, num_valid = self._fit_spec_tokens(seq, budget)
            if spec:
                if self.block_manager.allocate(seq, 1 + len(spec)):
                    out.scheduled.append(_Planned(seq, 1 + len(spec), spec, num_valid))
                    budget -= 1 + len(spec)
                    continue
                seq.clear_spec()  # no room for the drafts: decode one token, preempting if need be
            while not self._allocate(seq, num_new):
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
                out.scheduled.append(_Planned(seq, num_new))
                budget -= num_new

        # New sequences join only when nobody had to be preempted: otherwise they would take the
        # blocks that the preempted ones need to resume.
        if out.preempted:
            return out
        adapters = {s.request.lora_slot for s in self.running} - {0}
        index = 0  # waiting sequences skipped so far: their adapter would exceed max_loras
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            slot = seq.request.lora_slot
            if slot and slot not in adapters and len(adapters) >= (self.max_loras or 0):
                index += 1  # its adapter waits for a running one's to finish (vLLM's rule)
                continue
            prefix = self._cached_prefix(seq)
            num_new = seq.num_tokens - len(prefix) * self.block_manager.block_size
            # Without chunked prefill a prompt goes in one step; only a preempted sequence whose prompt
            # plus output outgrew the whole budget is recomputed in chunks, or it could never resume. An
            # encoder's input always goes whole (the input processor keeps it within the budget).
            can_chunk = (self.enable_chunked_prefill or num_new > self.max_num_batched_tokens) and not seq.kv_free
            if num_new > budget and not can_chunk:
                break
            num_new = min(num_new, budget)
            if can_chunk:
                num_new = self._prefill_cap(seq, num_new, out, len(prefix) * self.block_manager.block_size)
            if not self._allocate(seq, num_new, prefix):
                break
            self.waiting.pop(index)
            if slot:
                adapters.add(slot)
            if not seq.kv_free:  # an encoder's input has no cache to look in
                self.stats.prefix_cache_queries += seq.num_tokens
                self.stats.prefix_cache_hits += len(prefix) * self.block_manager.block_size
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.num_cached_tokens = len(prefix) * self.block_manager.block_size
            if seq.request.metrics.events is not None:
                seq.request.metrics.record(
                    "resumed" if seq.num_preemptions else "scheduled", time.time(),
                    sample=seq.index, cached_tokens=len(prefix) * self.block_manager.block_size,
                )  # fmt: skip
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(_Planned(seq, num_new))
            budget -= num_new
        return out

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks of the sequence's prompt found in the prefix cache. A cached position would go
        unscored: with prompt logprobs the prefix serves only positions whose prompt logprobs are known
        (none, at first: vLLM's rule), so they are computed, not kept; a pooling sequence that pools more
        than its last row (MEAN, CLS) needs every row's hidden state, so it computes them all."""
        if seq.kv_free:
            return []
        pooling = seq.request.pooling
        if pooling is not None and pooling.pooling_type != "LAST":
            return self.block_manager.match_prefix(seq, 0)
        limit = len(seq.request.prompt_logprobs) // self.block_manager.block_size
        return self.block_manager.match_prefix(seq, limit if seq.needs_prompt_logprobs else None)

    def _allocate(self, seq: Sequence, num_new: int, prefix: list[int] | None = None) -> bool:
        """BlockManager.allocate, for a sequence that keeps K/V (an encoder's input holds no blocks)."""
        return seq.kv_free or self.block_manager.allocate(seq, num_new, prefix)

    def _batch(self, plan: _Plan) -> StepBatch:
        """The plan as the runner's StepBatch: decodes first, then prefill chunks."""
        plan.scheduled.sort(key=lambda s: s.num_real_tokens > 1)
        seqs = []
        windowed = self.block_manager.window_pool is not None
        now = None  # taken once, for the first traced prefill chunk
        for s in plan.scheduled:
            seq, start, num_real, completes = s.seq, s.seq.num_computed_tokens, s.num_real_tokens, s.completes
            metrics = seq.request.metrics
            if metrics.events is not None and (num_real > 1 or start < seq.num_prompt_tokens):
                now = now or time.time()
                metrics.record("prefill_chunk", now, sample=seq.index, start=start, tokens=num_real)
            sampling = None
            pooling = seq.request.pooling
            if completes and pooling is None:
                sampling = SamplingInput(
                    seq.params, seq.token_ids, seq.num_prompt_tokens, seq.generator, seq.spec_draft_probs
                )
            new_tokens = seq.token_ids[start : start + num_real] + s.spec_token_ids
            seqs.append(
                ScheduledSeq(
                    seq_id=seq.seq_id, request_id=seq.request.request_id, start=start, token_ids=new_tokens,
                    num_draft_tokens=len(s.spec_token_ids), block_table=seq.block_table, seq_len=seq.num_tokens,
                    completes=completes, sampling=sampling,
                    prompt_logprobs=_prompt_logprobs_input(seq, start, num_real),
                    window_block_table=seq.window_block_table if windowed else None,
                    lora_slot=seq.request.lora_slot, pooling=pooling,
                )
            )  # fmt: skip
        self._fill_bitmasks(plan.scheduled, seqs)
        self._in_flight = {s.seq.seq_id: s.seq for s in plan.scheduled}
        batch = StepBatch(seqs, self._ended_seq_ids)
        self._ended_seq_ids = []
        return batch

    def _fill_bitmasks(self, planned: list[_Planned], seqs: list[ScheduledSeq]) -> None:
        """The allowed tokens of every position a constrained sequence samples this step, all at once."""
        constrained = [
            (p, grammar, sampling)
            for p, s in zip(planned, seqs)
            if (sampling := s.sampling) is not None and (grammar := p.seq.grammar) is not None
        ]
        if not constrained:
            return
        if self._bitmasks is None:
            self._bitmasks = BitmaskFiller(constrained[0][1].vocab_size)
        masks = self._bitmasks.fill(
            [
                (grammar, p.spec_token_ids[: p.num_valid_drafts], 1 + len(p.spec_token_ids))
                for p, grammar, _ in constrained
            ]
        )
        for (_, _, sampling), mask in zip(constrained, masks):
            sampling.token_bitmask = mask

    def in_flight(self) -> list[Sequence]:
        """The sequences of the last batch that schedule() returned."""
        return list(self._in_flight.values())

    def update_from_output(self, batch: StepBatch, result: StepResult, seconds: float) -> list[SeqUpdate]:
        """Applies a step the runner computed in `seconds`: every scheduled token now has K/V (of a
        speculating sequence only its last token and the accepted drafts), full blocks enter the
        prefix cache, sampled tokens are appended, blocks of rejected drafts are released, and
        sequences that reached a stop token or their length limit finish, as do pooling sequences whose
        last token was computed (with their result, StepResult.pooled). Returns what each sequence
        gained: the pooling sequences first, then the sampled ones in result order."""
        # Without the linear fit only the token count matters (the per-size table).
        self.step_cost.observe(
            step_shape(batch) if self.step_cost.linear_fit else StepShape(batch.num_tokens),
            seconds,
            speculative=any(s.num_draft_tokens for s in batch.seqs),
        )
        seqs = self._in_flight
        for seq_id, entries in result.prompt_logprobs.items():
            seqs[seq_id].request.prompt_logprobs += entries
        updates = []
        for s in batch.seqs:
            seq = seqs[s.seq_id]
            if not s.num_draft_tokens:
                seq.num_computed_tokens += s.num_new_tokens
                if not seq.kv_free:
                    self.block_manager.commit(seq)
            seq.clear_spec()
            if s.pooling is not None and s.completes and not seq.is_finished:
                # A pooling sequence ends with its prefill: its result replaces any generated token.
                seq.request.pooled = result.pooled[s.seq_id]
                self.finish(seq, "stop")
                updates.append(SeqUpdate(seq, [], []))
        now = time.time()
        for r in result.seqs:
            seq = seqs[r.seq_id]
            if seq.is_finished:  # aborted while the step ran
                continue
            if r.num_draft_tokens:
                seq.num_computed_tokens += 1 + r.num_accepted
                self.stats.record_spec(r.num_draft_tokens, r.num_accepted)
                m = seq.request.metrics
                m.spec_num_drafts += 1
                m.spec_num_draft_tokens += r.num_draft_tokens
                m.spec_num_accepted_tokens += r.num_accepted
            kept = 0
            for token in r.token_ids:
                kept += 1
                self._append_token(seq, token, now)
                if seq.is_finished:
                    break
            if r.num_draft_tokens and not seq.is_finished:
                self.block_manager.trim(seq, seq.num_tokens)
                self.block_manager.commit(seq)
            updates.append(SeqUpdate(seq, r.token_ids[:kept], r.logprobs[:kept]))
        self._in_flight = {}
        return updates

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        """Appends a sampled token and finishes the sequence at a stop token or its length limit.
        Stop strings need the text: the output processor finishes those (finish_at_stop_string)."""
        params, metrics = seq.params, seq.request.metrics
        seq.token_ids.append(token)
        self.stats.num_generation_tokens += 1
        if seq.index == 0:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.num_generated_tokens += 1
        if seq.grammar is not None and self._advance_grammar(seq, token):
            return
        n_out = seq.num_output_tokens
        can_stop = n_out >= params.min_tokens
        if can_stop and not params.ignore_eos and token in self.eos_token_ids:
            self.finish(seq, "stop", token)
        elif can_stop and token in (params.stop_token_ids or ()):
            self.finish(seq, "stop", token)
        elif n_out >= params.max_tokens or (self.max_model_len is not None and seq.num_tokens >= self.max_model_len):
            self.finish(seq, "length")

    def _advance_grammar(self, seq: Sequence, token: int) -> bool:
        """Advances the sequence's grammar past its new token; True when that ended the sequence: the
        grammar is complete ("stop", before any length limit the same token reached) or has failed
        ("rejected", the reason in stop_reason)."""
        grammar = seq.grammar
        constraint = seq.params.structured_outputs
        assert grammar is not None and constraint is not None, "only a constrained sequence has a grammar"
        # The masks allow only grammatical tokens; a matcher can still fail on its own limits (then
        # only EOS was allowed): an output cut short must not pass for a complete one. Such a failure is
        # the constraint's (GrammarCompiler finds most at compile time), so the request is rejected, every
        # sample of it: they share the constraint.
        if not grammar.accept(token) or grammar.error:
            kind = constraint.kind
            reason = grammar.error or f"token {token} outside the grammar"
            message = f"structured outputs ({kind}): at output token {seq.num_output_tokens}: {reason}"
            for sample in seq.request.seqs:
                self.finish(sample, "rejected", message)
            return True
        if grammar.is_terminated:
            self.finish(seq, "stop", token if token in self.eos_token_ids else None)
            return True
        return False

    def finish_at_stop_string(self, seq: Sequence, stop: str, num_output_tokens: int) -> None:
        """Ends seq at a stop string that its text reached with its first num_output_tokens output
        tokens. Tokens after those are dropped, and the stop string takes precedence over a length
        limit or stop token that a later token (or the same token, for the limit) reached."""
        dropped = seq.num_output_tokens - num_output_tokens
        if dropped:
            del seq.token_ids[seq.num_prompt_tokens + num_output_tokens :]
            self.stats.num_generation_tokens -= dropped
            if seq.index == 0:
                seq.request.metrics.num_generated_tokens -= dropped
        if not seq.is_finished:
            self.finish(seq, "stop", stop)
            return
        reasons = self.stats.finished_reasons
        finished_as = seq.finish_reason
        assert finished_as is not None, "a finished sequence has a finish reason"
        reasons[finished_as] -= 1
        if not reasons[finished_as]:
            del reasons[finished_as]
        reasons["stop"] = reasons.get("stop", 0) + 1
        seq.finish_reason, seq.stop_reason = "stop", stop

    def _prefill_cap(self, seq: Sequence, num_new: int, out: _Plan, start: int | None = None) -> int:
        """num_new, or fewer prefill tokens if the step would otherwise slow its decodes beyond
        max_decode_slowdown (at least one token, so that the prompt always advances)."""
        if self.max_decode_slowdown is None or num_new <= 1:
            return num_new
        decodes = [s for s in out.scheduled if s.num_real_tokens == 1 and s.completes]
        if not decodes:
            return num_new
        cost = self.step_cost
        alone = cost.predict(_Plan(decodes).shape)
        if alone is None:
            return num_new
        limit = self.max_decode_slowdown * alone
        shape = out.shape
        start = seq.num_computed_tokens if start is None else start

        def fits(n: int) -> bool:
            seconds = cost.predict(shape + StepShape.of(start, n))
            assert seconds is not None, "the model predicted `alone`: it is fitted"
            return seconds <= limit

        if fits(num_new):
            return num_new
        low, high = 1, num_new  # the predicted time grows with n: the largest n that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low

    def _fit_spec_tokens(self, seq: Sequence, budget: int) -> tuple[list[int], int]:
        """The draft tokens of a decoding sequence that fit the token budget next to its own token,
        and how many of them, from the first, its grammar allows (all without a grammar)."""
        if not seq.spec_token_ids or seq.num_uncomputed_tokens != 1:
            return [], 0
        room = budget - 1
        valid = len(seq.spec_token_ids)
        if seq.grammar is not None:
            # A draft the grammar refuses is rejected: the drafts after it are not worth verifying. A
            # sampled draft model's refused draft stays, though: its rejection draws the token from the
            # residual max(0, p - q), as losslessness needs (dropping it would draw from p).
            valid = seq.grammar.valid_prefix(seq.spec_token_ids)
            keep_refused = (
                valid < len(seq.spec_token_ids) and seq.spec_draft_probs is not None and not seq.params.greedy
            )
            room = min(room, valid + keep_refused)
        if room < len(seq.spec_token_ids):
            seq.spec_token_ids = seq.spec_token_ids[:room]
            if seq.spec_draft_probs is not None:
                seq.spec_draft_probs = seq.spec_draft_probs[:room]
        return seq.spec_token_ids, min(valid, len(seq.spec_token_ids))

    def _preempt(self, seq: Sequence) -> None:
        seq.num_preemptions += 1
        seq.request.metrics.record("preempted", time.time(), sample=seq.index, lost_tokens=seq.num_computed_tokens)
        self.block_manager.free_seq(seq)
        self._ended_seq_ids.append(seq.seq_id)
        seq.num_computed_tokens = 0
        self.running.remove(seq)
        self.add(seq)
        self.stats.num_preemptions += 1
        seq.request.metrics.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Ends seq wherever it is (waiting or running) and returns its blocks at once."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        self._ended_seq_ids.append(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.stats.finished_reasons[reason] = self.stats.finished_reasons.get(reason, 0) + 1
