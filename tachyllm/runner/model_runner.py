"""Turns a StepBatch into one forward pass over a flattened token batch, then samples.

The batch is ordered decodes first (a sequence's last token, plus any draft tokens to verify),
then prefill chunks, with no padding between sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from tachyllm import faults, tracing
from tachyllm.kernels.paged_attention import AttentionMetadata, PrefillSpan, runs_native
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.sampling.sampler import Sampler
from tachyllm.sampling.verify import verify
from tachyllm.step import ScheduledSeq, SeqResult, StepBatch, StepResult

# Prompts at least this long keep a contiguous K/V copy while they are prefilled in chunks.
CHUNK_BUFFER_MIN_TOKENS = 256


@dataclass(eq=False)
class _ChunkBuffer:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    filled: int = 0  # leading positions holding valid K/V


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sampler: Sampler,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        # Whether the C++ kernel computes attention (CPU): it reads every sequence's context from
        # the paged cache by block table.
        k_cache = kv_caches[0][0]
        self.native_attention = runs_native(k_cache)
        # A quantized cache is read back even by a prompt's first chunk (instead of its fresh K/V),
        # so that a prompt computes the same whether its prefix comes from the cache or not.
        self.read_back_first_chunk = not isinstance(k_cache, torch.Tensor)
        # Otherwise a long prompt prefilled in chunks keeps a contiguous K/V copy; quantized caches
        # dequantize on read, which the copy would skip.
        self.use_chunk_buffers = isinstance(k_cache, torch.Tensor) and not self.native_attention
        self.chunk_buffers: dict[int, _ChunkBuffer] = {}

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        """Runs the step; returns what each sequence that reached its next token gained."""
        seqs = batch.seqs
        hidden = self._forward(batch)
        plain_rows, plain, spec_rows, spec = [], [], [], []
        end = 0
        for s in seqs:
            end += s.num_new_tokens
            if s.num_draft_tokens:
                spec_rows += range(end - s.num_new_tokens, end)  # every position is checked
                spec.append(s)
            elif s.completes:
                plain_rows.append(end - 1)
                plain.append(s)
        if not plain_rows and not spec_rows:
            return StepResult([])
        logits = self.model.compute_logits(hidden[torch.tensor(plain_rows + spec_rows, device=self.device)])
        faults.check("sample", seqs)
        with tracing.span("sample"):
            return StepResult(self._sample(logits, plain, len(plain_rows), spec))

    def _sample(self, logits: torch.Tensor, plain: list[ScheduledSeq], num_plain: int, spec: list[ScheduledSeq]) -> list[SeqResult]:
        results = []
        if plain:
            sampled = self.sampler(logits[:num_plain], [s.sampling for s in plain])
            results += [
                SeqResult(s.seq_id, [token], [logprob]) for s, token, logprob in zip(plain, sampled.token_ids, sampled.logprobs)
            ]
        if spec:
            for s, (tokens, logprobs) in zip(spec, verify(self.sampler, logits[num_plain:], spec)):
                results.append(SeqResult(s.seq_id, tokens, logprobs, s.num_draft_tokens, len(tokens) - 1))
        return results

    @torch.inference_mode()
    def last_token_logits(self, batch: StepBatch) -> torch.Tensor:
        """Logits of each sequence's last scheduled position, in batch order (a draft model's step)."""
        hidden = self._forward(batch)
        ends = torch.tensor([s.num_new_tokens for s in batch.seqs]).cumsum(0) - 1
        return self.model.compute_logits(hidden[ends.to(self.device)])

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        faults.check("prepare", batch.seqs)
        for seq_id in batch.finished_seq_ids:
            self.chunk_buffers.pop(seq_id, None)
        with tracing.span("prepare_inputs"):
            input_ids, positions, meta = self._prepare(batch.seqs)
        faults.check("forward", batch.seqs)
        with tracing.span("forward"):
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        for s in batch.seqs:
            buffer = self.chunk_buffers.get(s.seq_id)
            if buffer is not None:
                buffer.filled = s.start + s.num_new_tokens
                if s.completes:  # the prompt is done: decodes read the paged cache
                    del self.chunk_buffers[s.seq_id]
        return hidden

    def _chunk_buffer(self, s: ScheduledSeq) -> _ChunkBuffer | None:
        """The contiguous K/V copy for a long prompt prefilled in several chunks (created at its
        first chunk, or after a preemption reset it)."""
        start, length = s.start, s.seq_len
        if not self.use_chunk_buffers or length < CHUNK_BUFFER_MIN_TOKENS or (start == 0 and s.completes):
            return None
        buffer = self.chunk_buffers.get(s.seq_id)
        if buffer is None or buffer.filled > start or buffer.kv.shape[3] < length:
            k_cache = self.kv_caches[0][0]
            layers, kv_heads, head_dim = len(self.kv_caches), k_cache.shape[2], k_cache.shape[3]
            kv = torch.empty(layers, 2, kv_heads, length, head_dim, dtype=k_cache.dtype, device=self.device)
            buffer = self.chunk_buffers[s.seq_id] = _ChunkBuffer(kv)
        return buffer

    def _slots(self, block_tables: list[list[int]], num_slots: int) -> torch.Tensor:
        """Flat cache slots of positions [0, num_slots) for each block table, as [len(tables), num_slots]."""
        bs = self.block_size
        width = -(-num_slots // bs)
        table = torch.tensor([bt[:width] + [0] * (width - len(bt[:width])) for bt in block_tables], dtype=torch.long)
        slots = table.unsqueeze(-1) * bs + torch.arange(bs)
        return slots.view(len(block_tables), -1)[:, :num_slots]

    def _prepare(self, ordered: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        native = self.native_attention
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        # Sequences whose attention reads the paged cache by block table: the decodes, or with the
        # C++ kernel every sequence.
        tables, starts, counts = [], [], []
        prefills: list[PrefillSpan] = []
        for s in ordered:
            start, n = s.start, s.num_new_tokens
            table = s.block_table
            input_ids += s.token_ids
            positions += range(start, start + n)
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if native or s.num_real_tokens == 1:
                tables.append(table)
                starts.append(start)
                counts.append(n)
            else:
                offset = len(input_ids) - n
                read_back = start > 0 or self.read_back_first_chunk
                slots = self._slots([table], start + n)[0].to(self.device) if read_back else None
                span = PrefillSpan(offset, offset + n, slots, start)
                buffer = self._chunk_buffer(s)
                if buffer is not None:
                    span.buffer, span.buffer_filled = buffer.kv, buffer.filled
                prefills.append(span)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            num_decode_tokens=sum(counts),
            decode_slots=None,
            decode_bias=None,
            prefills=prefills,
        )
        if tables and native:
            first_rows = [0] + list(accumulate(counts))[:-1]
            meta.seq_info = torch.tensor(list(zip(first_rows, counts, starts)), dtype=torch.int32)
            width = max(len(t) for t in tables)
            meta.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        elif tables:
            self._decode_metadata(meta, tables, starts, counts)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta

    def _decode_metadata(
        self, meta: AttentionMetadata, tables: list[list[int]], starts: list[int], counts: list[int]
    ) -> None:
        """Context slots and masks of the decodes; query j of a decode starting at position p sees
        positions <= p + j (padding queries repeat the decode's last one)."""
        queries = max(counts)
        starts_t, counts_t = torch.tensor(starts), torch.tensor(counts)
        max_len = int((starts_t + counts_t).max())
        meta.decode_slots = self._slots(tables, max_len).to(self.device)
        j = torch.arange(queries).unsqueeze(0)
        last_visible = starts_t.unsqueeze(1) + torch.minimum(j, counts_t.unsqueeze(1) - 1)  # [B, queries]
        hidden_slot = torch.arange(max_len).view(1, 1, -1) > last_visible.unsqueeze(-1)
        bias = torch.zeros(len(tables), queries, max_len).masked_fill(hidden_slot, float("-inf"))
        meta.decode_bias = bias.view(len(tables), 1, queries, 1, max_len).to(self.device)
        meta.decode_queries = queries
        if min(counts) != queries:
            first_row = counts_t.cumsum(0) - counts_t
            padded = first_row.unsqueeze(1) + torch.minimum(j, counts_t.unsqueeze(1) - 1)
            real = (j < counts_t.unsqueeze(1)).flatten()
            meta.decode_query_rows = padded.flatten().to(self.device)
            meta.decode_output_rows = torch.arange(len(tables) * queries)[real].to(self.device)

