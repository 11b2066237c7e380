"""A LoRA-wrapped linear with random adapters in slots 1-3, and the steps that drive it, for the kernel
tests (tests/test_lora_kernels.py, tests/test_batch_invariance.py)."""

from __future__ import annotations

import torch
from torch import nn

from tachyllm.lora.layers import LoRALinear, StepSegments
from tachyllm.step import ScheduledSeq

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# Per slot: (rank, scale, the projections it targets).
ADAPTERS = {1: (8, 2.0, PROJECTIONS), 2: (4, 0.5, PROJECTIONS), 3: (16, 1.0, ("q_proj", "v_proj"))}


def lora_linear(
    in_features: int, out_sizes: list[int], dtype: torch.dtype, segments: StepSegments, seed: int = 0
) -> LoRALinear:
    """A bias-free base linear in `dtype` with the adapters of ADAPTERS loaded (the same for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    base = nn.Linear(in_features, sum(out_sizes), bias=False)
    base.weight.data = (torch.randn(sum(out_sizes), in_features, generator=gen) * in_features**-0.5).to(dtype)
    linear = LoRALinear(base, PROJECTIONS, in_features, out_sizes, segments)
    for slot, (rank, scale, targets) in ADAPTERS.items():
        pieces = {
            p: (torch.randn(rank, in_features, generator=gen) * 0.3, torch.randn(size, rank, generator=gen) * 0.3)
            for p, size in zip(PROJECTIONS, out_sizes)
            if p in targets
        }
        linear.set_adapter(slot, pieces, scale)
    return linear


def seqs(step: list[tuple[int, int]]) -> list[ScheduledSeq]:
    """A step of sequences given as (LoRA slot, new tokens); slot 0: the base model (also the
    encoder tests' plain steps)."""
    return [
        ScheduledSeq(
            seq_id=i,
            request_id=str(i),
            start=0,
            token_ids=[1] * n,
            num_draft_tokens=0,
            block_table=[],
            seq_len=n,
            completes=True,
            lora_slot=slot,
        )  # fmt: skip
        for i, (slot, n) in enumerate(step)
    ]
