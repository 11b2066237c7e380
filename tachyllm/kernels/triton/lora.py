"""LoRA shrink and expand as Triton kernels, in the form CUDA graphs can replay: every buffer has a
fixed shape and the adapter of each row is read on the device, so a step launches them without a
host sync whatever adapters its rows run.

An adapter slot's weights for one wrapped linear live in banks of fixed size, one entry per slot:
  - `a_bank` [slots, projections * max_rank, in]: the stacked A of the projections that share the
    input (q/k/v, gate/up), projection p's ranks at [p * max_rank, p * max_rank + its rank), zeros
    after them (a lower rank, or a projection the adapter does not target);
  - `bt_bank` [slots, max_rank, out]: scale · Bᵀ of every projection in its own output columns,
    zero rows past its rank.
`row_slots` int32 [rows] gives each row's slot, -1 for a row of the base model (left as it is).

shrink: s[t, j] = x[t] · a_bank[slot(t), j]  (fp32);
expand: out[t, c] = round(out[t, c] + Σ_j s[t, p(c) · max_rank + j] · bt_bank[slot(t), j, c]), with p(c)
the projection of column c (its first columns given by `bounds`).
Both accumulate in fp32 and round the output once, as the PyTorch path (lora/layers.py) does. A row is
one program's: its result never depends on the other rows (batch invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features per step of the shrink
BLOCK_N = 64  # output columns per expand program


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slot_ptr, s_ptr, K, R, x_stride,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    if slot >= 0:
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * x_stride + ks, mask=ks < K, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + (slot * R + ranks[:, None]) * K + ks[None, :],
                mask=(ranks[:, None] < R) & (ks[None, :] < K),
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(s_ptr + t * R + ranks, acc, mask=ranks < R)


@triton.jit
def _expand_kernel(
    out_ptr, s_ptr, bt_ptr, slot_ptr, N, R, out_stride, BOUND1, BOUND2,
    MAX_RANK: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if slot >= 0:
        proj = (cols >= BOUND1).to(tl.int32) + (cols >= BOUND2).to(tl.int32)
        ranks = tl.arange(0, MAX_RANK)
        s = tl.load(s_ptr + t * R + proj[None, :] * MAX_RANK + ranks[:, None], mask=cols[None, :] < N, other=0.0)
        bt = tl.load(
            bt_ptr + (slot * MAX_RANK + ranks[:, None]) * N + cols[None, :], mask=cols[None, :] < N, other=0.0
        ).to(tl.float32)
        delta = tl.sum(s * bt, axis=0)
        base = tl.load(out_ptr + t * out_stride + cols, mask=cols < N, other=0.0)
        tl.store(out_ptr + t * out_stride + cols, (base.to(tl.float32) + delta).to(base.dtype), mask=cols < N)


def lora_shrink(x: torch.Tensor, a_bank: torch.Tensor, row_slots: torch.Tensor, shrunk: torch.Tensor) -> None:
    """shrunk [rows, projections * max_rank] fp32 <- each adapter row's x · Aᵀ (base rows' left as they are)."""
    rows, k = x.shape
    r = a_bank.shape[1]
    assert a_bank.shape[2] == k and x.stride(1) == 1, "x [rows, in] with contiguous rows, a_bank [slots, R, in]"
    assert shrunk.shape == (rows, r) and shrunk.dtype == torch.float32 and shrunk.is_contiguous()
    assert row_slots.shape == (rows,) and row_slots.dtype == torch.int32 and a_bank.is_contiguous()
    block_r = min(triton.next_power_of_2(r), 64)
    _shrink_kernel[(rows, triton.cdiv(r, block_r))](
        x, a_bank, row_slots, shrunk, k, r, x.stride(0), BLOCK_R=block_r, BLOCK_K=BLOCK_K
    )


def lora_expand(
    out: torch.Tensor, shrunk: torch.Tensor, bt_bank: torch.Tensor, row_slots: torch.Tensor, bounds: tuple[int, ...]
) -> None:
    """out[t] += the adapter of row t's expand, in place; `bounds`: the first column of each projection
    after the first (up to two: q/k/v)."""
    rows, n = out.shape
    max_rank = bt_bank.shape[1]
    assert bt_bank.shape[2] == n and out.stride(1) == 1, "out [rows, out] with contiguous rows, bt_bank [slots, r, out]"
    assert max_rank == triton.next_power_of_2(max_rank), "the banks' max rank is a power of two"
    assert shrunk.shape[0] == rows and shrunk.shape[1] >= (len(bounds) + 1) * max_rank and shrunk.is_contiguous()
    assert len(bounds) <= 2 and row_slots.shape == (rows,) and row_slots.dtype == torch.int32
    bound1, bound2 = (*bounds, n, n)[:2]
    assert bt_bank.is_contiguous(), "a bank is one contiguous buffer"
    _expand_kernel[(rows, triton.cdiv(n, BLOCK_N))](
        out, shrunk, bt_bank, row_slots, n, shrunk.shape[1], out.stride(0), bound1, bound2,
        MAX_RANK=max_rank, BLOCK_N=BLOCK_N,
    )  # fmt: skip
