"""The Triton LoRA shrink / expand kernels (kernels/triton/lora.py) on the CPU through Triton's
interpreter, against the same products in PyTorch: fixed-size banks, a slot per row (-1: a base row,
left as it is), q/k/v columns expanded from their own ranks, rows independent of their batch.

Tolerance: fp32 accumulation in another summation order than PyTorch's (rtol 1e-5); bf16 outputs
within two bf16 ulps (the interpreter's bf16 conversion truncates, tests/test_triton_ops.py)."""

from __future__ import annotations

import pytest
import torch

from tachyllm.kernels.triton.lora import lora_expand, lora_shrink

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IN, OUTS, MAX_RANK, SLOTS = 80, [48, 16, 16], 16, 3
# Per slot: rank and the projections (of q, k, v) it targets.
ADAPTERS = [(16, (0, 1, 2)), (4, (0, 2)), (8, (1,))]


def _banks(seed: int = 0):
    """Banks of SLOTS adapters, and each slot's dense per-projection (A, scale · B) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    a_bank = torch.zeros(SLOTS, len(OUTS) * MAX_RANK, IN)
    bt_bank = torch.zeros(SLOTS, MAX_RANK, sum(OUTS))
    dense = []
    for slot, (rank, targets) in enumerate(ADAPTERS):
        pieces, col = {}, 0
        for p, size in enumerate(OUTS):
            if p in targets:
                a, b = torch.randn(rank, IN, generator=gen) * 0.3, torch.randn(size, rank, generator=gen) * 0.3
                a_bank[slot, p * MAX_RANK : p * MAX_RANK + rank] = a
                bt_bank[slot, :rank, col : col + size] = b.T
                pieces[p] = (a, b, col)
            col += size
        dense.append(pieces)
    return a_bank.to(DEVICE), bt_bank.to(DEVICE), dense


def _reference(x: torch.Tensor, out: torch.Tensor, row_slots: list[int], dense) -> torch.Tensor:
    want = out.clone()
    for t, slot in enumerate(row_slots):
        if slot < 0:
            continue
        for a, b, col in dense[slot].values():
            delta = (x[t].double() @ a.double().T) @ b.double().T
            want[t, col : col + b.shape[0]] = (out[t, col : col + b.shape[0]].double() + delta).to(out.dtype)
    return want


def _run(x: torch.Tensor, out: torch.Tensor, row_slots: list[int], a_bank, bt_bank) -> torch.Tensor:
    slots = torch.tensor(row_slots, dtype=torch.int32, device=DEVICE)
    shrunk = torch.zeros(x.shape[0], a_bank.shape[1], device=DEVICE)
    lora_shrink(x, a_bank, slots, shrunk)
    result = out.clone()
    lora_expand(result, shrunk, bt_bank, slots, bounds=(OUTS[0], OUTS[0] + OUTS[1]))
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_expand_match_pytorch(dtype):
    a_bank, bt_bank, dense = _banks()
    row_slots = [0, -1, 1, 2, 0, -1, 1]
    x = torch.randn(len(row_slots), IN).to(DEVICE, dtype)
    out = torch.randn(len(row_slots), sum(OUTS)).to(DEVICE, dtype)
    got, want = _run(x, out, row_slots, a_bank, bt_bank), _reference(x, out, row_slots, dense)
    base_rows = torch.tensor([s < 0 for s in row_slots])
    assert torch.equal(got[base_rows], out[base_rows])  # base rows untouched
    # slot 2 targets k only: its q and v columns stay the base's
    assert torch.equal(got[3, : OUTS[0]], out[3, : OUTS[0]])
    rtol = 1e-5 if dtype == torch.float32 else 2**-6
    err = (got.float() - want.float()).abs()
    assert (err <= rtol * (want.float().abs() + 1)).all(), f"max error {err.max()}"
    assert not torch.equal(got[~base_rows], out[~base_rows])


def test_rows_independent_of_batch():
    """A row's result alone and among others, in any order: the same bits."""
    a_bank, bt_bank, _ = _banks()
    x, out = torch.randn(6, IN, device=DEVICE), torch.randn(6, sum(OUTS), device=DEVICE)
    row_slots = [1, 0, -1, 2, 0, 1]
    together = _run(x, out, row_slots, a_bank, bt_bank)
    for t in range(6):
        alone = _run(x[t : t + 1], out[t : t + 1], row_slots[t : t + 1], a_bank, bt_bank)
        assert torch.equal(alone[0], together[t])


def test_bad_buffers_refused():
    a_bank, bt_bank, _ = _banks()
    x, out = torch.randn(2, IN, device=DEVICE), torch.randn(2, sum(OUTS), device=DEVICE)
    shrunk = torch.zeros(2, a_bank.shape[1], device=DEVICE)
    with pytest.raises(AssertionError):
        lora_shrink(x, a_bank, torch.tensor([0, 1], device=DEVICE), shrunk)  # int64 slots
    with pytest.raises(AssertionError):
        lora_shrink(x[:, :-1], a_bank, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), shrunk)
    with pytest.raises(AssertionError):
        lora_expand(out, shrunk, bt_bank[:, :12], torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), (48, 64))
