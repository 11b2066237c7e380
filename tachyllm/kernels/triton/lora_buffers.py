"""LoRAStep and LoRASlots, the interface the wrapped linears (lora/layers.py) call, over the Triton
shrink and expand of lora.py: the cuda backend's LoRA kernels (Backend.lora_kernels). Every buffer a
kernel launch reads has a fixed size and address:

- `LoRAStep(max_tokens, max_rank, device)`: the adapter slot of each row of the step, int32
  [max_tokens] on the device (-1: a row of the base model), rewritten in place at every step by one
  asynchronous upload from a host copy (pinned on a GPU); and the shrink's fp32 scratch, room for
  max_tokens rows of every projection's ranks.
- `LoRASlots(in_features, out_sizes, max_rank, num_slots, dtype, device)`: one wrapped linear's
  adapters stacked in banks with an entry per slot, allocated when the model is wrapped (before the KV
  cache takes the device memory left) (kernels/triton/lora.py has their layout; entry 0, the base
  model's, stays zero, and so do the ranks past an adapter's own and the projections it does not
  target), so `apply` launches one shrink and one expand over every row of the step, in shapes that
  depend on the row count alone, whatever adapters the step's rows run.

No launch depends on the step's adapters on the host, and the step's slots reach the device without
a host sync: the form CUDA graphs replay. Where more adapters are loaded than `num_slots` (the
manager keeps every adapter of the unfinished requests loaded) a linear's banks are reallocated
larger, once per new highest slot.

The banks' rank is max_rank rounded up to a power of two (the expand's tile over ranks); an entry's
weights are stored in `dtype`, fp32 or bf16, and the kernels widen them to fp32 as they load them.
"""

from __future__ import annotations

import torch

from tachyllm.kernels.triton.lora import lora_expand, lora_shrink

# The wrapped linears build these with sizes (the C++ kernels' classes take none): lora/layers.py.
FIXED_SIZE = True
MAX_PROJECTIONS = 3  # q/k/v: the most projections a wrapped linear holds


def bank_rank(max_rank: int) -> int:
    """The ranks a bank holds per projection: max_rank rounded up to a power of two."""
    if max_rank < 1:
        raise ValueError(f"max_rank must be at least 1, got {max_rank}")
    return 1 << (max_rank - 1).bit_length()


class LoRAStep:
    """The step's row -> adapter slot index on the device, set once per step (`set`, the C++ LoRAStep's
    arguments: segment i holds rows[offsets[i]:offsets[i + 1]] of slot slots[i], on the host; without
    rows, one segment holds every row)."""

    def __init__(self, max_tokens: int, max_rank: int, device: torch.device):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.device = device
        self.row_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self._host = torch.full((max_tokens,), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._host_view = self._host.numpy()
        self.shrunk = torch.zeros(
            max_tokens * MAX_PROJECTIONS * bank_rank(max_rank), dtype=torch.float32, device=device
        )
        self.highest_slot = 0  # the highest slot of the step's rows (0: none)
        self._written = 0  # the leading entries of row_slots that may hold a slot
        # The last upload's end: the host copy is free again after it.
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def set(self, rows: torch.Tensor | None, offsets: list[int], slots: list[int]) -> None:
        if len(offsets) != (len(slots) + 1 if slots else 0):
            raise ValueError("offsets must be one more than slots")
        if any(not 0 <= a <= b for a, b in zip(offsets, offsets[1:])):
            raise ValueError("offsets must be ascending from 0")
        if any(slot < 0 for slot in slots):
            raise ValueError(f"a slot is a non-negative index, got {slots}")
        if rows is None and (len(slots) > 1 or (slots and offsets[0] != 0)):
            raise ValueError("without rows, one segment holds every row")
        if rows is not None and (rows.dtype != torch.long or rows.dim() != 1 or rows.device.type != "cpu"):
            raise ValueError("rows must be int64 [rows] on the host")
        if rows is not None and rows.numel() != offsets[-1]:
            raise ValueError("the offsets must end at the number of rows")
        index = rows.numpy() if rows is not None else None
        end = 0 if not slots else offsets[-1] if index is None else int(index.max(initial=-1)) + 1
        if end > self.max_tokens or (index is not None and (index < 0).any()):
            raise ValueError(f"a row index is out of range: the step has room for {self.max_tokens} rows")
        if self._uploaded is not None:  # the last upload has read the host copy (long since, normally)
            self._uploaded.synchronize()
        host = self._host_view
        host[: self._written] = -1
        if index is None and slots:
            host[:end] = slots[0]
        elif index is not None:
            for slot, begin, stop in zip(slots, offsets, offsets[1:]):
                host[index[begin:stop]] = slot
        upload = max(end, self._written)
        self.row_slots[:upload].copy_(self._host[:upload], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record(torch.cuda.current_stream(self.device))
        self._written = end
        self.highest_slot = max(slots, default=0)


class LoRASlots:
    """The adapters loaded into one wrapped linear, by slot, in fixed-size banks; `set` and `clear` take
    the C++ LoRASlots's arguments (A [ranks, in]; Bt, each projection's scale · Bᵀ [rank, columns]
    flat one after the other; the layout int64 [projections, 4] of (first output column, columns, first
    rank, rank)); `apply` adds the step's adapter rows to a base output in place."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        max_rank: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if not 1 <= len(out_sizes) <= MAX_PROJECTIONS:
            raise ValueError(f"a wrapped linear holds 1 to {MAX_PROJECTIONS} projections, got {len(out_sizes)}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        self.starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.out_sizes = out_sizes
        self.rank = bank_rank(max_rank)
        self.dtype, self.device = dtype, device
        entries = num_slots + 1
        self.a_bank = torch.zeros(entries, len(out_sizes) * self.rank, in_features, dtype=dtype, device=device)
        self.bt_bank = torch.zeros(entries, self.rank, sum(out_sizes), dtype=dtype, device=device)
        self.loaded: set[int] = set()  # the slots with weights here

    def set(self, slot: int, a: torch.Tensor, bt: torch.Tensor, layout: torch.Tensor) -> None:
        if slot < 0:
            raise ValueError(f"a slot is a non-negative index, got {slot}")
        if a.dim() != 2 or bt.dim() != 1 or a.dtype != bt.dtype or a.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("A must be fp32 or bf16 [ranks, in] and Bt flat in A's dtype")
        if layout.dtype != torch.long or layout.dim() != 2 or layout.shape[1] != 4:
            raise ValueError("a layout is int64 [projections, 4]")
        if a.shape[1] != self.a_bank.shape[2]:
            raise ValueError(f"the adapter's A has {a.shape[1]} input features, the linear {self.a_bank.shape[2]}")
        projections = layout.tolist()
        for col0, cols, rank0, rank in projections:
            if col0 not in self.starts or cols != self.out_sizes[self.starts.index(col0)]:
                raise ValueError(f"columns {col0}..{col0 + cols} are not one projection of {self.out_sizes}")
            if rank > self.rank or rank0 < 0 or rank0 + rank > a.shape[0]:
                raise ValueError(f"a projection's ranks {rank0}..{rank0 + rank} exceed A or the banks' {self.rank}")
        if bt.numel() != sum(cols * rank for _, cols, _, rank in projections):
            raise ValueError("Bt must hold each projection's [rank, columns] in turn")
        a_entry = torch.zeros(len(self.starts) * self.rank, a.shape[1], dtype=self.dtype, device=self.device)
        bt_entry = torch.zeros(self.bt_bank.shape[1:], dtype=self.dtype, device=self.device)
        offset = 0
        for col0, cols, rank0, rank in projections:
            first = self.starts.index(col0) * self.rank
            a_entry[first : first + rank] = a[rank0 : rank0 + rank]
            bt_entry[:rank, col0 : col0 + cols] = bt[offset : offset + rank * cols].view(rank, cols)
            offset += rank * cols
        self._fit(slot)
        self.a_bank[slot] = a_entry
        self.bt_bank[slot] = bt_entry
        self.loaded.add(slot)

    def clear(self, slot: int) -> None:
        if slot in self.loaded:
            self.a_bank[slot] = 0
            self.bt_bank[slot] = 0
            self.loaded.discard(slot)

    def apply(self, out: torch.Tensor, x: torch.Tensor, step: LoRAStep) -> None:
        """out += each adapter row's scale · (x Aᵀ) Bᵀ, in place (rows of slots without weights here: + 0)."""
        if not self.loaded:  # no adapter has weights in this linear: nothing to launch
            return
        rows = x.shape[0]
        if x.dim() != 2 or out.dim() != 2 or out.shape[0] != rows or out.shape[1] != self.bt_bank.shape[2]:
            raise ValueError(f"x [rows, in] and out [rows, {self.bt_bank.shape[2]}] expected")
        if rows > step.max_tokens:
            raise ValueError(f"a step of {rows} rows exceeds the {step.max_tokens} the LoRA step buffers hold")
        self._fit(step.highest_slot)  # a slot that has no weights here reads a zero entry
        width = self.a_bank.shape[1]
        shrunk = step.shrunk[: rows * width].view(rows, width)
        row_slots = step.row_slots[:rows]
        lora_shrink(x, self.a_bank, row_slots, shrunk)
        lora_expand(out, shrunk, self.bt_bank, row_slots, tuple(self.starts[1:]))

    def _fit(self, slot: int) -> None:
        """Grows the banks (zero entries) to hold `slot`."""
        entries = self.a_bank.shape[0]
        if slot < entries:
            return
        grown = max(slot + 1, 2 * entries)
        a_bank = torch.zeros(grown, *self.a_bank.shape[1:], dtype=self.dtype, device=self.device)
        bt_bank = torch.zeros(grown, *self.bt_bank.shape[1:], dtype=self.dtype, device=self.device)
        a_bank[:entries], bt_bank[:entries] = self.a_bank, self.bt_bank
        self.a_bank, self.bt_bank = a_bank, bt_bank
