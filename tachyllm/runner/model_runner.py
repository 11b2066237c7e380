"""Runs one step: a StepBatch through the model (inputs and attention metadata from the backend's
MetadataBuilder), then samples, and returns a StepResult. Reads nothing but the batch.

The batch is ordered decodes first (a sequence's last token, plus any draft tokens to verify),
then prefill chunks, with no padding between sequences.
"""

from __future__ import annotations

import logging

import torch

from tachyllm import faults, tracing
from tachyllm.backends.base import ENCODER_STEP_ROW_MULTIPLE, AttentionMetadata, Backend, LayerKV
from tachyllm.lora.layers import StepSegments
from tachyllm.models.bert import BertModel
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.models.pooler import PoolingState, class_probabilities, finish_embedding, pool_chunk
from tachyllm.runner.cuda_graphs import DecodeGraphs
from tachyllm.sampling.sampler import Sampler, logprob_rows, to_device
from tachyllm.sampling.verify import sampling_input, verify
from tachyllm.step import LogprobInfo, PoolingInput, ScheduledSeq, SeqResult, StepBatch, StepResult

logger = logging.getLogger("tachyllm")

# Prompt rows scored through the LM head at once: a whole 2048-token chunk's fp32 logits would take
# 400 MB at a 49152-token vocabulary; 256 rows take 50 MB.
PROMPT_LOGPROB_ROWS = 256


class EncoderRunner:
    """Runs an encoder's step (docs/pooling.md): every sequence is a whole input, computed at once with
    no KV cache and pooled; the StepResult carries each one's result."""

    def __init__(self, model: BertModel, backend: Backend):
        self.model = model
        self.backend = backend
        self.pooling = PoolingRows()

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        faults.check("prepare", batch.seqs)
        with tracing.span("prepare_inputs"):
            input_ids, positions, token_types, meta = self.backend.prepare_encoder(batch)
        faults.check("forward", batch.seqs)
        # On all the engine's threads, a lone short query's step too: one thread would leave a core to the
        # server's event loop and its client, but made served single queries slower at the median and no
        # faster at p99 (docs/design_measurements.md#served-embedding-latency).
        with tracing.span("forward"):
            hidden = self.model(input_ids, positions, token_types, meta)
        faults.check("sample", batch.seqs)
        return StepResult([], pooled=self.pooling.pool(hidden, batch, self.model))

    @torch.inference_mode()
    def warm_up(self, max_rows: int) -> None:
        """Runs one input of each padded step size up to `max_rows` tokens, so that oneDNN's kernels for
        those row counts are built before the first request rather than during it."""
        for rows in range(ENCODER_STEP_ROW_MULTIPLE, max_rows + 1, ENCODER_STEP_ROW_MULTIPLE):
            seq = ScheduledSeq(
                seq_id=-1, request_id="warm-up", start=0, token_ids=[0] * rows, num_draft_tokens=0,
                block_table=[], seq_len=rows, completes=True,
            )  # fmt: skip
            self.model(*self.backend.prepare_encoder(StepBatch([seq])))


class PoolingRows:
    """A step's pooling sequences' rows -> their results; keeps what a chunked prompt's earlier chunks
    contributed (models/pooler.py), dropped when the sequence ends."""

    def __init__(self) -> None:
        self.states: dict[int, PoolingState] = {}

    def pool(
        self, hidden: torch.Tensor, batch: StepBatch, model: LlamaForCausalLM | BertModel
    ) -> dict[int, torch.Tensor]:
        for seq_id in batch.finished_seq_ids:
            self.states.pop(seq_id, None)
        results: dict[int, torch.Tensor] = {}
        row = 0
        for s in batch.seqs:
            n, pooling = s.num_new_tokens, s.pooling
            if pooling is not None:
                if s.start == 0:  # a first chunk, or a recompute after preemption: nothing carried over
                    self.states.pop(s.seq_id, None)
                state = self.states.setdefault(s.seq_id, PoolingState())
                pooled = pool_chunk(hidden[row : row + n], pooling.pooling_type, state, s.completes)
                if pooled is not None:
                    del self.states[s.seq_id]
                    results[s.seq_id] = _pooled_result(pooled, pooling, model).cpu()
            row += n
        return results


def _pooled_result(pooled: torch.Tensor, pooling: PoolingInput, model: LlamaForCausalLM | BertModel) -> torch.Tensor:
    """A pooled vector as its task wants it: an embedding, or the classification head's probabilities."""
    if pooling.task == "embed":
        return finish_embedding(pooled, pooling)
    assert isinstance(model, BertModel), "only an encoder with a classification head serves classify / score"
    return class_probabilities(model.classify(pooled.to(model.word_embeddings.weight.dtype).unsqueeze(0))[0])


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerKV],
        block_size: int,
        sampler: Sampler | None,  # None on a tensor-parallel worker rank, which never samples
        backend: Backend,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.backend = backend
        self.device = backend.device
        self.builder = backend.metadata_builder(kv_caches, block_size)
        self.pooling = PoolingRows()  # a causal model served as an embedder (--convert embed)
        self.graphs: DecodeGraphs | None = None
        # The LoRA wrappers' view of the step's rows (tachyllm/lora), when adapters are served.
        self.lora_segments: StepSegments | None = None

    @property
    def _sampler(self) -> Sampler:
        assert self.sampler is not None, "only a worker rank has no sampler, and it runs execute_shard"
        return self.sampler

    def use_graphs(
        self, max_num_seqs: int, max_blocks: int, query_counts: tuple[int, ...], capture: bool = True
    ) -> None:
        """Decode-only steps of these queries per sequence (and block tables of up to max_blocks) run
        padded to their batch-size bucket, replaying graphs captured now (capture=False: the padded
        forward eagerly; tests)."""
        self.graphs = DecodeGraphs(
            self.model, self.builder, self.kv_caches, max_num_seqs, max_blocks, query_counts, capture
        )
        seconds, used = self.graphs.capture_all()
        if capture:
            logger.info("CUDA graphs: %s captured in %.1f s, %.0f MiB", self.graphs.describe(), seconds, used / 2**20)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        """Runs the step; returns what each sequence that reached its next token gained."""
        seqs = batch.seqs
        hidden = self._forward(batch)
        plain_rows, plain, spec_rows, spec = _sampled_rows(seqs)
        prompt_logprobs = self._prompt_logprobs(hidden, seqs)
        pooled = self.pooling.pool(hidden, batch, self.model) if any(s.pooling for s in seqs) else {}
        if not plain_rows and not spec_rows:
            return StepResult([], prompt_logprobs, pooled)
        logits = self.model.compute_logits(hidden[to_device(plain_rows + spec_rows, torch.long, self.device)])
        faults.check("sample", seqs)
        with tracing.span("sample"):
            return StepResult(self._sample(logits, plain, len(plain_rows), spec), prompt_logprobs, pooled)

    @torch.inference_mode()
    def execute_shard(self, batch: StepBatch) -> None:
        """A tensor-parallel worker rank's share of `execute`: the same forward and the same LM-head
        calls in the same order (each joins collectives with rank 0), without sampling."""
        hidden = self._forward(batch)
        rows = _prompt_rows(batch.seqs)[0]
        for i in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            self.model.compute_logits(hidden[torch.tensor(rows[i : i + PROMPT_LOGPROB_ROWS], device=self.device)])
        plain_rows, _, spec_rows, _ = _sampled_rows(batch.seqs)
        if plain_rows or spec_rows:
            self.model.compute_logits(hidden[torch.tensor(plain_rows + spec_rows, device=self.device)])

    def _prompt_logprobs(self, hidden: torch.Tensor, seqs: list[ScheduledSeq]) -> dict[int, list[LogprobInfo]]:
        """The prompt rows the batch asks to score (ScheduledSeq.prompt_logprobs), from this step's own
        hidden states: each row's log-softmax over the vocabulary, at the prompt token that follows it."""
        rows, targets, nums, owners = _prompt_rows(seqs)
        if not rows:
            return {}
        entries: list[LogprobInfo] = []
        for i in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = slice(i, i + PROMPT_LOGPROB_ROWS)
            logits = self.model.compute_logits(hidden[torch.tensor(rows[part], device=self.device)])
            raw = torch.log_softmax(logits[:, : self._sampler.vocab_size], dim=-1)
            scored = logprob_rows(raw, torch.tensor(targets[part], device=self.device), nums[part])
            entries += [entry for entry in scored if entry is not None]  # every row has a number: none is None
        out, pos = {}, 0
        for seq_id, count in owners:
            out[seq_id] = entries[pos : pos + count]
            pos += count
        return out

    def _sample(
        self, logits: torch.Tensor, plain: list[ScheduledSeq], num_plain: int, spec: list[ScheduledSeq]
    ) -> list[SeqResult]:
        results = []
        if plain:
            sampled = self._sampler(logits[:num_plain], [sampling_input(s) for s in plain])
            results += [
                SeqResult(s.seq_id, [token], [logprob])
                for s, token, logprob in zip(plain, sampled.token_ids, sampled.logprobs)
            ]
        if spec:
            for s, (tokens, logprobs) in zip(spec, verify(self._sampler, logits[num_plain:], spec)):
                results.append(SeqResult(s.seq_id, tokens, logprobs, s.num_draft_tokens, len(tokens) - 1))
        return results

    @torch.inference_mode()
    def last_token_logits(self, batch: StepBatch) -> torch.Tensor:
        """Logits of each sequence's last scheduled position, in batch order (a draft model's step)."""
        hidden = self._forward(batch)
        ends = torch.tensor([s.num_new_tokens for s in batch.seqs]).cumsum(0) - 1
        return self.model.compute_logits(hidden[ends.to(self.device)])

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states [batch.num_tokens, hidden] of every token of the step, as a step computes
        them (teacher-forced scoring: eval/quality.py)."""
        return self._forward(batch)

    def prepare(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata) of the step, made by the backend's builder."""
        return self.builder.prepare(batch)

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        faults.check("prepare", batch.seqs)
        if self.lora_segments is not None:
            self.lora_segments.set_step(batch.seqs)
        graphs = self.graphs
        bucket = graphs.bucket(batch) if graphs is not None else None
        if graphs is not None and bucket is not None:
            with tracing.span("prepare_inputs"):
                inputs = graphs.prepare(batch, bucket)
            faults.check("forward", batch.seqs)
            with tracing.span("forward"):
                return graphs.replay(bucket, inputs)[: batch.num_tokens]
        with tracing.span("prepare_inputs"):
            input_ids, positions, meta = self.prepare(batch)
        faults.check("forward", batch.seqs)
        with tracing.span("forward"):
            hidden: torch.Tensor = self.model(input_ids, positions, self.kv_caches, meta)
            return hidden


def _sampled_rows(seqs: list[ScheduledSeq]) -> tuple[list[int], list[ScheduledSeq], list[int], list[ScheduledSeq]]:
    """(rows sampled plainly, their sequences, rows of speculating sequences, theirs), in batch order."""
    plain_rows: list[int] = []
    spec_rows: list[int] = []
    plain: list[ScheduledSeq] = []
    spec: list[ScheduledSeq] = []
    end = 0
    for s in seqs:
        end += s.num_new_tokens
        if s.num_draft_tokens:
            spec_rows += range(end - s.num_new_tokens, end)  # every position is checked
            spec.append(s)
        elif s.completes and s.pooling is None:
            plain_rows.append(end - 1)
            plain.append(s)
    return plain_rows, plain, spec_rows, spec


def _prompt_rows(seqs: list[ScheduledSeq]) -> tuple[list[int], list[int], list[int | None], list[tuple[int, int]]]:
    """(rows to score, the prompt token each is scored for, top-N of each, (seq id, row count) per sequence)."""
    rows: list[int] = []
    targets: list[int] = []
    nums: list[int | None] = []
    owners: list[tuple[int, int]] = []
    start = 0
    for s in seqs:
        want = s.prompt_logprobs
        if want is not None:
            first = start + want.first_row
            rows += range(first, first + len(want.target_ids))
            targets += want.target_ids
            nums += [want.num_logprobs] * len(want.target_ids)
            owners.append((s.seq_id, len(want.target_ids)))
        start += s.num_new_tokens
    return rows, targets, nums, owners
