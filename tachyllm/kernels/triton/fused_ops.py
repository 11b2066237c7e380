"""The model layers' elementwise ops as Triton kernels, one launch each: RMSNorm, residual add + RMSNorm
(both results from one pass), rotary embedding of q and k together, SiLU-and-multiply and
GELU(tanh)-and-multiply.

They round where the portable ops (backends/base.py LayerOps) round, so that on the GPU they agree
with them to the bit except where an fp32 reduction or transcendental differs in its last bit: the
norm's mean of squares is summed in fp32 in another order, and exp / rsqrt are the GPU's. In detail:
RMSNorm normalises in fp32, rounds to the model dtype, then multiplies by the weight with one more
rounding (LayerOps: `weight * xf.to(x.dtype)`); the residual sum is rounded to the model dtype before
it is normalised; rotary rounds each product and the sum as the dtype-typed PyTorch expression does;
the activation is rounded before the multiplication by up.

Under triton 3.7.1's interpreter a conversion to bf16 truncates instead of rounding to nearest, so on
the CPU bf16 results may differ from PyTorch's by one unit in the last place (fp32 and fp16 do not).

Each row (token) is one program: nothing depends on the other rows (batch invariance).
Triton over torch.compile for these: pending the GPU measurement (docs/quantization.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if ADD:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * H + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * inv).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (w * normed).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, Q_HEADS, KV_HEADS,
    HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)  # one token: its q heads, then its k heads, as the rows of one tile
    h = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (h < Q_HEADS + KV_HEADS) & (cols < HALF)
    is_q = h < Q_HEADS
    kh = tl.maximum(h - Q_HEADS, 0)
    src = tl.where(is_q, q_ptr + t * q_stride_t + h * q_stride_h, k_ptr + t * k_stride_t + kh * k_stride_h)
    dst = tl.where(is_q, qo_ptr + (t * Q_HEADS + h) * 2 * HALF, ko_ptr + (t * KV_HEADS + kh) * 2 * HALF)
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    x1 = tl.load(src + cols, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + cols, mask=mask, other=0.0)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # Each product rounded to the dtype, then the sum (as x1 * cos - x2 * sin in that dtype does).
    o1 = ((a1 * c).to(dtype).to(tl.float32) - (a2 * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(dst + cols, o1, mask=mask)
    tl.store(dst + HALF + cols, o2, mask=mask)


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, INTER, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * 2 * INTER + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * 2 * INTER + INTER + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    if GELU:
        # 0.5 g (1 + tanh(u)) = g * sigmoid(2u): no cancellation where tanh is near -1.
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi)
        act = g / (1.0 + tl.exp(-2.0 * tl.maximum(u, -40.0)))  # exp stays finite; the result ~0 there
    else:
        act = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * INTER + cols, (act.to(dtype).to(tl.float32) * up.to(tl.float32)).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty_like(x2)
    h = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, h, eps, ADD=False, BLOCK=triton.next_power_of_2(h))
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) in one pass."""
    x2, r2 = _rows(x), _rows(residual)
    out, total = torch.empty_like(x2), torch.empty_like(x2)
    h = x2.shape[1]
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, total, h, eps, ADD=True, BLOCK=triton.next_power_of_2(h))
    return out.view(x.shape), total.view(x.shape)


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] (strided views of a fused qkv
    output are read as they are) rotated in the half-split layout; new contiguous tensors."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1:
        q, k = q.contiguous(), k.contiguous()
    half = head_dim // 2
    if cos.shape[-1] != half or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError(f"rotary: cos / sin must be contiguous [positions, {half}], got {tuple(cos.shape)}")
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, kv_heads, head_dim, dtype=k.dtype, device=k.device)
    if tokens:
        _rotary_kernel[(tokens,)](
            q, k, q_out, k_out, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_heads, kv_heads,
            HALF=half, BLOCK=triton.next_power_of_2(half), BLOCK_H=triton.next_power_of_2(q_heads + kv_heads),
        )  # fmt: skip
    return q_out, k_out


def _act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    x2 = _rows(gate_up)
    inter = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=x2.dtype, device=x2.device)
    block = min(1024, triton.next_power_of_2(inter))
    if x2.shape[0]:
        _act_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, inter, GELU=gelu, BLOCK=block)
    return out.view(*gate_up.shape[:-1], inter)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    return _act_mul(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's MLP)."""
    return _act_mul(gate_up, gelu=True)
