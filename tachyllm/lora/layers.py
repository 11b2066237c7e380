"""LoRA applied unmerged: each targeted linear of the model is wrapped (a module swap over whatever the
base linear is: bf16 / fp32, int8 / int4, GGUF blocks, a pre-quantized checkpoint's packed kernels),
and adds scale · (x Aᵀ) Bᵀ to the rows of each adapter of the step.

The step's rows are grouped by adapter (segments): each adapter present reads its A and B once per
step, shrinks all its rows with one matmul (the projections of one input, q/k/v or gate/up, shrunk
together through their stacked A) and expands each projection into its own output columns, with an
fp32 accumulator; rows of the base model skip all of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from tachyllm.errors import ConfigError
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.option_values import DTYPES
from tachyllm.quantization.apply import QUANTIZED_LINEARS
from tachyllm.quantization.int8 import quantize_int8
from tachyllm.step import ScheduledSeq

# The activations the kernels' LoRASlots.apply takes; others (fp16) run the PyTorch path.
NATIVE_DTYPES = (torch.bfloat16, torch.float32)
# Each wrapped module of a decoder layer: its path, and the PEFT projections fused in it, in output order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


@dataclass
class StepSegments:
    """The current step's rows grouped by adapter slot, computed once per step for every wrapped linear:
    `slots` in order, segment i holding rows[offsets[i]:offsets[i + 1]] of the step (`rows` on the host,
    None when one slot holds every row; the PyTorch path copies them to the device at its first
    segments() of the step, which kernels reading the step on the device do not need). Base-model
    rows (slot 0) are left out. `kernels`: the backend's LoRA kernels (Backend.lora_kernels; None:
    PyTorch matmuls), chosen when the engine is built; `native`, their copy of the step, which the
    wrapped linears and the fused decoder layers read. `activations`: the model's activation dtype;
    `lora_dtype`: how the adapters' weights are stored (EngineConfig.lora_dtype; weight_dtype_for has
    the rule). Kernels whose
    buffers have a fixed size (`FIXED_SIZE`: the Triton ones) are built for steps of up to `max_tokens`
    rows, adapters of up to `max_rank` and `num_slots` adapters loaded."""

    device: torch.device
    kernels: ModuleType | None = None
    activations: torch.dtype = torch.float32
    max_tokens: int = 0
    max_rank: int = 0
    num_slots: int = 0
    lora_dtype: str = "auto"
    slots: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    rows: torch.Tensor | None = None
    native: Any = field(init=False, default=None)  # kernels.LoRAStep
    _device_rows: torch.Tensor | None = field(init=False, default=None)  # `rows` on the device

    def __post_init__(self) -> None:
        if self.lora_dtype == "int8" and not getattr(self.kernels, "LORA_INT8_WEIGHTS", False):
            raise ConfigError("lora_dtype int8 needs the CPU backend's LoRA kernels (--backend cpu)")
        if self.lora_dtype == "bfloat16" and (self.kernels is None or self.activations != torch.bfloat16):
            raise ConfigError(
                "lora_dtype bfloat16 needs bf16 activations (--dtype bfloat16) and the backend's LoRA kernels"
            )
        if self.kernels is not None:
            fixed_size = getattr(self.kernels, "FIXED_SIZE", False)
            args = (self.max_tokens, self.max_rank, self.device) if fixed_size else ()
            self.native = self.kernels.LoRAStep(*args)

    def kernel_slots(self, in_features: int, out_sizes: list[int], weight_dtype: torch.dtype) -> Any:
        """The kernels' LoRASlots for a wrapped linear of `in_features` and projections of `out_sizes`."""
        assert self.kernels is not None, "only with kernels"
        if getattr(self.kernels, "FIXED_SIZE", False):
            return self.kernels.LoRASlots(
                in_features, out_sizes, self.max_rank, self.num_slots, weight_dtype, self.device
            )
        return self.kernels.LoRASlots()

    def weight_dtype_for(self, base: nn.Module) -> torch.dtype:
        """The dtype a wrapped linear over `base` stores its adapters' A and scale · Bᵀ in. Over a
        quantized base (auto), int8 with a scale per rank where the kernels take it: a decode step
        reads every adapter's weights from memory beside the packed base weights', and bf16 adapters
        cost a quantized model's step several times their share of its bytes
        (docs/design_measurements.md#lora-adapters-over-quantized-weights); their rounding error is
        a small fraction of the base's 4-8-bit one. Otherwise bf16 for bf16 activations with kernels
        (the kernels widen them to fp32 as they load them), else fp32."""
        if self.lora_dtype != "auto":
            return torch.int8 if self.lora_dtype == "int8" else DTYPES[self.lora_dtype]
        if isinstance(base, QUANTIZED_LINEARS) and getattr(self.kernels, "LORA_INT8_WEIGHTS", False):
            return torch.int8
        if self.kernels is not None and self.activations == torch.bfloat16:
            return torch.bfloat16
        return torch.float32

    def set_step(self, seqs: list[ScheduledSeq]) -> None:
        self._group(seqs)
        if self.native is not None:
            self.native.set(self.rows, self.offsets, self.slots)

    def _group(self, seqs: list[ScheduledSeq]) -> None:
        self.rows = self._device_rows = None
        distinct = {s.lora_slot for s in seqs}
        if distinct == {0} or not distinct:
            self.slots, self.offsets = [], []
            return
        if len(distinct) == 1:
            self.slots, self.offsets = [distinct.pop()], [0, sum(s.num_new_tokens for s in seqs)]
            return
        by_slot: dict[int, list[int]] = {}
        start = 0
        for s in seqs:
            if s.lora_slot:
                by_slot.setdefault(s.lora_slot, []).extend(range(start, start + s.num_new_tokens))
            start += s.num_new_tokens
        self.slots = sorted(by_slot)
        index: list[int] = []
        self.offsets = [0]
        for slot in self.slots:
            index += by_slot[slot]
            self.offsets.append(len(index))
        self.rows = torch.tensor(index, dtype=torch.long)

    def segments(self) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, its rows of the step, or None for every row) per segment."""
        if self.rows is None:
            return [(slot, None) for slot in self.slots]
        if self._device_rows is None:
            self._device_rows = self.rows.to(self.device)
        rows = self._device_rows
        return [(slot, rows[self.offsets[i] : self.offsets[i + 1]]) for i, slot in enumerate(self.slots)]


@dataclass
class _SlotWeights:
    """One adapter's share of a wrapped linear, in the linear's weight dtype: the stacked A of its
    projections [sum of ranks, in]; `bt`, each projection's scale · Bᵀ [rank, columns] one after the
    other, flat; `layout`, int64 [projections, 4] rows of (first output column, columns, first rank,
    rank); per projection (output columns, ranks of the shrunk rows, its scale · Bᵀ as a view of
    `bt`); and for int8 weights `rank_scale`, fp32 [sum of ranks]: each rank's A row scale times its
    Bᵀ row scale (a projection's ranks are its own), by which the shrunk rows are multiplied."""

    stacked_a: torch.Tensor
    bt: torch.Tensor
    layout: torch.Tensor
    expands: list[tuple[slice, slice, torch.Tensor]]
    rank_scale: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A base linear plus the adapters loaded into it, each in a slot; applies the step's segments."""

    def __init__(
        self,
        base: nn.Module,
        projections: tuple[str, ...],
        in_features: int,
        out_sizes: list[int],
        segments: StepSegments,
    ):
        super().__init__()
        self.base = base
        self.projections = projections
        starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.columns = {p: slice(s, s + n) for p, s, n in zip(projections, starts, out_sizes)}
        self.segments = segments
        self.slots: dict[int, _SlotWeights] = {}
        self.weight_dtype = segments.weight_dtype_for(base)
        # The backend kernels' copy of the slots (the same tensors), where it has them.
        self.native = (
            segments.kernel_slots(in_features, out_sizes, self.weight_dtype) if segments.kernels is not None else None
        )

    def set_adapter(self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Loads an adapter's (A, B) of some of this linear's projections into `slot` (none: clears it)."""
        self.slots.pop(slot, None)
        if not pieces:
            return
        device = self.segments.device
        a_parts, bt_parts, layout, rank_start = [], [], [], 0
        for proj in self.projections:
            if proj not in pieces:
                continue
            a, b = pieces[proj]
            a_parts.append(a.float())
            bt_parts.append((b.float() * scale).T.contiguous())  # B is scaled in fp32, then rounded once
            columns = self.columns[proj]
            layout.append((columns.start, columns.stop - columns.start, rank_start, a.shape[0]))
            rank_start += a.shape[0]
        dtype, rank_scale = self.weight_dtype, None
        if dtype == torch.int8:
            (a_codes, a_scale), bt_quantized = quantize_int8(torch.cat(a_parts)), [quantize_int8(p) for p in bt_parts]
            a_parts, bt_parts = [a_codes], [codes for codes, _ in bt_quantized]
            rank_scale = (a_scale * torch.cat([s for _, s in bt_quantized])).to(device)
        bt = torch.cat([p.flatten() for p in bt_parts]).to(device=device, dtype=dtype)
        expands, offset = [], 0
        for (col0, cols, rank0, rank), proj in zip(layout, (p for p in self.projections if p in pieces)):
            view = bt[offset : offset + rank * cols].view(rank, cols)
            expands.append((self.columns[proj], slice(rank0, rank0 + rank), view))
            offset += rank * cols
        weights = _SlotWeights(
            torch.cat(a_parts).to(device=device, dtype=dtype).contiguous(),
            bt,
            torch.tensor(layout, dtype=torch.long),
            expands,
            rank_scale,
        )
        self.slots[slot] = weights
        if self.native is not None:
            if rank_scale is None:
                self.native.set(slot, weights.stacked_a, weights.bt, weights.layout)
            else:
                self.native.set(slot, weights.stacked_a, weights.bt, weights.layout, rank_scale)

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        """The weight tensors of `slot`, with every view of their storages (none if it is empty)."""
        weights = self.slots.get(slot)
        if weights is None:
            return []
        views = [bt for _, _, bt in weights.expands]
        return [weights.stacked_a, weights.bt, *views, *([] if weights.rank_scale is None else [weights.rank_scale])]

    def clear_adapter(self, slot: int) -> None:
        self.slots.pop(slot, None)
        if self.native is not None:
            self.native.clear(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.segments
        if not step.slots:
            return out
        if self.native is not None and out.dtype in NATIVE_DTYPES and x.dtype == out.dtype:
            self.native.apply(out, x, step.native)
            return out
        for slot, rows in step.segments():
            weights = self.slots.get(slot)
            if weights is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            shrunk = xs.float() @ weights.stacked_a.float().T
            if weights.rank_scale is not None:
                shrunk *= weights.rank_scale
            target = out if rows is None else out.index_select(0, rows)
            for columns, ranks, bt in weights.expands:
                target[:, columns] = (target[:, columns].float() + shrunk[:, ranks] @ bt.float()).to(out.dtype)
            if rows is not None:
                out.index_copy_(0, rows, target)
        return out


def attach_lora(model: LlamaForCausalLM, shapes: dict[str, tuple[int, int]], segments: StepSegments) -> list[dict]:
    """Wraps every targetable linear of the model's decoder layers; returns, per layer, its wrappers by
    the PEFT projection names they hold. `shapes`: each projection's (input, output) features."""
    per_layer = []
    for layer in model.layers:
        wrapped = {}
        for path, projections in FUSED_PROJECTIONS.items():
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            in_features, out_sizes = shapes[projections[0]][0], [shapes[p][1] for p in projections]
            wrapper = LoRALinear(getattr(owner, attr), projections, in_features, out_sizes, segments)
            setattr(owner, attr, wrapper)
            wrapped.update({p: wrapper for p in projections})
        per_layer.append(wrapped)
    return per_layer
