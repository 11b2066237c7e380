"""Runs one step: a StepBatch through the model (inputs and attention metadata from the backend's
MetadataBuilder), then samples.

The batch is ordered decodes first (a sequence's last token, plus any draft tokens to verify),
then prefill chunks, with no padding between sequences.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tachyllm import faults
from tachyllm.backends.base import AttentionMetadata, Backend, LayerKV
from tachyllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from tachyllm.engine.sequence import Sequence, SequenceStatus
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.runner.sampler import Sampler
from tachyllm.spec_decode.rejection import verify
from tachyllm.step import SamplingInput, StepBatch
from tachyllm.step import ScheduledSeq as StepSeq

LogprobInfo = tuple[float, int, list[int], list[float]]


@dataclass
class SeqStepResult:
    """The tokens one sequence gained this step: one sampled token, or for a speculating sequence
    its accepted draft tokens followed by the target's own next token."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[LogprobInfo | None]
    num_draft_tokens: int = 0
    num_accepted: int = 0


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerKV],
        block_size: int,
        sampler: Sampler,
        backend: Backend,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.backend = backend
        self.device = backend.device
        self.builder = backend.metadata_builder(kv_caches, block_size)
        # Sequences whose last step left their prompt part-computed, for finished_seq_ids.
        self._prefilling: dict[int, Sequence] = {}

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> list[SeqStepResult]:
        """Runs the step; returns what each sequence that reached its next token gained."""
        ordered = _decode_first(sched.scheduled)
        hidden = self._forward(self._step_batch(ordered), [s.seq for s in ordered])
        plain_rows, plain_seqs, spec_rows, spec = [], [], [], []
        end = 0
        for s in ordered:
            end += s.num_new_tokens
            if s.spec_token_ids:
                spec_rows += range(end - s.num_new_tokens, end)  # every position is checked
                spec.append(s)
            elif s.completes:
                plain_rows.append(end - 1)
                plain_seqs.append(s.seq)
        if not plain_rows and not spec_rows:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(plain_rows + spec_rows, device=self.device)])
        faults.check("sample", (s.seq for s in ordered))
        results = []
        if plain_seqs:
            sampled = self.sampler(logits[: len(plain_rows)], plain_seqs)
            results += [
                SeqStepResult(seq, [token], [logprob])
                for seq, token, logprob in zip(plain_seqs, sampled.token_ids, sampled.logprobs)
            ]
        if spec:
            for s, (tokens, logprobs) in zip(spec, verify(self.sampler, logits[len(plain_rows) :], spec)):
                results.append(SeqStepResult(s.seq, tokens, logprobs, len(s.spec_token_ids), len(tokens) - 1))
        return results

    @torch.inference_mode()
    def last_token_logits(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Logits of each sequence's last scheduled position, in the given order (a draft model's step)."""
        ordered = _decode_first(scheduled)
        hidden = self._forward(self._step_batch(ordered), [s.seq for s in ordered])
        ends = torch.tensor([s.num_new_tokens for s in ordered]).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[ends.to(self.device)])
        order = {id(s): i for i, s in enumerate(ordered)}
        return logits[torch.tensor([order[id(s)] for s in scheduled], device=self.device)]

    def prepare(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata) of the step, made by the backend's builder."""
        return self.builder.prepare(batch)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states [batch.num_tokens, hidden] of every token of the step, as a step computes
        them (teacher-forced scoring: eval/quality.py)."""
        return self._forward(batch, ())

    def _forward(self, batch: StepBatch, seqs: Iterable[Sequence]) -> torch.Tensor:
        faults.check("prepare", seqs)
        input_ids, positions, meta = self.prepare(batch)
        faults.check("forward", seqs)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _step_batch(self, ordered: list[ScheduledSeq]) -> StepBatch:
        """The scheduler's step as a StepBatch, until the scheduler emits one itself."""
        finished = [i for i, seq in self._prefilling.items() if seq.status != SequenceStatus.RUNNING]
        for seq_id in finished:
            del self._prefilling[seq_id]
        seqs = []
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            sampling = None
            if s.completes:
                sampling = SamplingInput(
                    seq.params, seq.token_ids, seq.num_prompt_tokens, seq.generator, seq.spec_draft_probs
                )
                self._prefilling.pop(seq.seq_id, None)
            else:
                self._prefilling[seq.seq_id] = seq
            token_ids = seq.token_ids[start : start + s.num_real_tokens] + s.spec_token_ids
            seqs.append(
                StepSeq(
                    seq.seq_id,
                    seq.request.request_id,
                    start,
                    token_ids,
                    len(s.spec_token_ids),
                    seq.block_table,
                    seq.num_tokens,
                    sampling,
                )
            )
        return StepBatch(seqs, finished)


def _decode_first(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
    return sorted(scheduled, key=lambda s: s.num_real_tokens > 1)
