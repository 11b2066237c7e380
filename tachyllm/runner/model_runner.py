"""Turns a SchedulerOutput into one forward pass over a flattened token batch, then samples.

The batch is ordered decodes first, then prefill chunks, with no padding between sequences.
"""

from __future__ import annotations

import torch

from tachyllm.engine.scheduler import SchedulerOutput, ScheduledSeq
from tachyllm.engine.sequence import Sequence
from tachyllm.kernels.paged_attention import AttentionMetadata, PrefillSpan
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.runner.sampler import SampleResult, Sampler


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

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Sequence], SampleResult | None]:
        """Runs the step; returns the sequences that got a new token and the sampling result."""
        ordered = sorted(sched.scheduled, key=lambda s: s.num_new_tokens > 1)
        input_ids, positions, meta = self._prepare(ordered)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows, seqs, end = [], [], 0
        for s in ordered:
            end += s.num_new_tokens
            if s.completes:
                rows.append(end - 1)
                seqs.append(s.seq)
        if not rows:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return seqs, self.sampler(logits, seqs)

    def _slots(self, block_tables: list[list[int]], num_slots: int) -> torch.Tensor:
        """Flat cache slots of positions [0, num_slots) for each block table, as [len(tables), num_slots]."""
        bs = self.block_size
        width = -(-num_slots // bs)
        table = torch.tensor([bt[:width] + [0] * (width - len(bt[:width])) for bt in block_tables], dtype=torch.long)
        slots = table.unsqueeze(-1) * bs + torch.arange(bs)
        return slots.view(len(block_tables), -1)[:, :num_slots]

    def _prepare(self, ordered: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decode_tables, decode_lens = [], []
        prefills: list[PrefillSpan] = []
        for s in ordered:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            table = seq.block_table
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                offset = len(input_ids) - n
                slots = None if start == 0 else self._slots([table], start + n)[0].to(self.device)
                prefills.append(PrefillSpan(offset, offset + n, slots, start))

        decode_slots = decode_bias = None
        if decode_tables:
            max_len = max(decode_lens)
            decode_slots = self._slots(decode_tables, max_len).to(self.device)
            lens = torch.tensor(decode_lens).unsqueeze(1)
            bias = torch.zeros(len(decode_lens), max_len).masked_fill(torch.arange(max_len).unsqueeze(0) >= lens, float("-inf"))
            decode_bias = bias.view(len(decode_lens), 1, 1, max_len).to(self.device)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decode_tables),
            decode_slots=decode_slots,
            decode_bias=decode_bias,
            prefills=prefills,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta
