"""LoRA applied unmerged: each targeted linear of the model is wrapped (a module swap over whatever the
base linear is: bf16 / fp32, int8 / int4, GGUF blocks, a pre-quantized checkpoint's packed kernels),
and adds scale · (x Aᵀ) Bᵀ to the rows of each adapter of the step.

The step's rows are grouped by adapter (segments): each adapter present reads its A and B once per
step, shrinks all its rows with one matmul (the projections of one input, q/k/v or gate/up, shrunk
together through their stacked A) and expands each projection into its own output columns, with an
fp32 accumulator; rows of the base model skip all of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.step import ScheduledSeq

# Each wrapped module of a decoder layer: its path, and the PEFT projections fused in it, in output order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass
class StepSegments:
    """The current step's rows grouped by adapter slot, shared by every wrapped linear: (slot, row
    indices), or (slot, None) when the slot holds every row. Base-model rows (slot 0) are left out."""

    device: torch.device
    segments: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)

    def set_step(self, seqs: list[ScheduledSeq]) -> None:
        slots = {s.lora_slot for s in seqs}
        if slots == {0} or not slots:
            self.segments = []
            return
        if len(slots) == 1:
            self.segments = [(slots.pop(), None)]
            return
        rows: dict[int, list[int]] = {}
        start = 0
        for s in seqs:
            if s.lora_slot:
                rows.setdefault(s.lora_slot, []).extend(range(start, start + s.num_new_tokens))
            start += s.num_new_tokens
        self.segments = [
            (slot, torch.tensor(index, dtype=torch.long, device=self.device)) for slot, index in sorted(rows.items())
        ]


@dataclass
class _SlotWeights:
    """One adapter's share of a wrapped linear: the stacked A of its projections, and per projection
    (output columns, columns of the shrunk rows, scale · B)."""

    stacked_a: torch.Tensor  # fp32 [sum of ranks, in]
    expands: list[tuple[slice, slice, torch.Tensor]]


class LoRALinear(nn.Module):
    """A base linear plus the adapters loaded into it, each in a slot; applies the step's segments."""

    def __init__(self, base: nn.Module, projections: tuple[str, ...], out_sizes: list[int], segments: StepSegments):
        super().__init__()
        self.base = base
        self.projections = projections
        starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.columns = {p: slice(s, s + n) for p, s, n in zip(projections, starts, out_sizes)}
        self.segments = segments
        self.slots: dict[int, _SlotWeights] = {}

    def set_adapter(self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Loads an adapter's (A, B) of some of this linear's projections into `slot` (none: clears it)."""
        self.slots.pop(slot, None)
        if not pieces:
            return
        device = self.segments.device
        a_parts, expands, rank_start = [], [], 0
        for proj in self.projections:
            if proj not in pieces:
                continue
            a, b = pieces[proj]
            a_parts.append(a)
            rank = a.shape[0]
            expands.append((self.columns[proj], slice(rank_start, rank_start + rank), (b * scale).to(device)))
            rank_start += rank
        self.slots[slot] = _SlotWeights(torch.cat(a_parts).to(device), expands)

    def clear_adapter(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, rows in self.segments.segments:
            weights = self.slots.get(slot)
            if weights is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs.float() @ weights.stacked_a.T
            target = out if rows is None else out.index_select(0, rows)
            for columns, ranks, scaled_b in weights.expands:
                target[:, columns] = (target[:, columns].float() + shrunk[:, ranks] @ scaled_b.T).to(out.dtype)
            if rows is not None:
                out.index_copy_(0, rows, target)
        return out


def attach_lora(model: LlamaForCausalLM, out_sizes: dict[str, int], segments: StepSegments) -> list[dict]:
    """Wraps every targetable linear of the model's decoder layers; returns, per layer, its wrappers by
    the PEFT projection names they hold. `out_sizes`: each projection's output features."""
    per_layer = []
    for layer in model.layers:
        wrapped = {}
        for path, projections in FUSED_PROJECTIONS.items():
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            wrapper = LoRALinear(getattr(owner, attr), projections, [out_sizes[p] for p in projections], segments)
            setattr(owner, attr, wrapper)
            wrapped.update({p: wrapper for p in projections})
        per_layer.append(wrapped)
    return per_layer
