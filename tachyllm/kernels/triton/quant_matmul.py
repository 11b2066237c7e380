"""Weight-only quantized matmuls in Triton, dequantizing inside the tile loop (the weights stream from
memory packed and never exist dequantized): y = x @ W^T (+ bias) for x [M, K] and a quantized W [N, K].

int4, group-wise: one layout for every source (tachyllm's RTN int4, AWQ, GPTQ, GGUF Q4_0 / Q4_1):
all of them reach quantization/int4.Int4Weight (w = code * scale + min per (row, group), codes
0..15) exactly, and `pack_int4` turns that into
  qweight int32 [K / 8, N]: word (k // 8, n) holds the codes of columns k..k+7 of row n, column
      k + i in bits 4i..4i+3 (packed along K, so a tile's loads run along N, coalesced);
  scales, mins [K / group, N]: fp16 where that holds them exactly (GGUF's fp16 d and m, symmetric
      checkpoints), else fp32 (RTN's fp32 scales, AWQ / GPTQ mins -s * z with up to 15 significant
      bits), so the dequantized weights are bit-identical to the source's own dequantization.
The kernel computes code * scale + min in fp32, rounds the tile to the activation dtype and
accumulates tl.dot in fp32.

int8 weight-only: qweight int8 [K, N] and one fp32 scale per output channel, applied to the fp32
accumulator (the per-channel factor commutes with the sum).

Batch invariance (docs/determinism.md): the tile shape is fixed (it does not follow M), so a row's
sum runs in the same order whatever else the call holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyllm.kernels.triton import interpreting

# Tiles: BLOCK_K divides every group size (32, 64, 128), so a K tile reads one row of scales.
# Fixed for every M (batch invariance); chosen for correctness first, pending tuning on the GPU.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32
PACK = 8  # int4 codes per int32 word


def pack_int4(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] (0..15), scales / mins fp32 [N, K / group] -> (qweight, scales, mins) of
    the kernel's layout (module docstring). Exact: `dequantize_int4` of the result equals
    codes * scales + mins computed in fp32."""
    n, k = codes.shape
    if k % group_size or group_size % BLOCK_K:
        raise ValueError(f"int4 matmul: group size {group_size} must be a multiple of {BLOCK_K} dividing K={k}")
    fields = codes.to(torch.int32).t().reshape(k // PACK, PACK, n)
    words = torch.zeros(k // PACK, n, dtype=torch.int32, device=codes.device)
    for i in range(PACK):
        words |= fields[:, i] << (4 * i)  # bit 31 set for codes >= 8 in the last field: a negative int32
    return words.contiguous(), _compact(scales.t()), _compact(mins.t())


def _compact(t: torch.Tensor) -> torch.Tensor:
    """fp16 where every value survives the round trip (half the bytes per group), else fp32."""
    t = t.float().contiguous()
    half = t.half()
    return half if torch.equal(half.float(), t) else t


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 [N, K] of the packed layout: what the kernel multiplies before rounding to the activation dtype."""
    k8, n = qweight.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    codes = ((qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF).reshape(k8 * PACK, n)
    s = scales.float().repeat_interleave(group_size, dim=0)
    m = mins.float().repeat_interleave(group_size, dim=0)
    return (codes.float() * s + m).t().contiguous()


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> the kernel's [K, N]."""
    return codes.t().contiguous()


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 activations: an IEEE fp32 dot (not TF32). bf16 under triton 3.7.1's interpreter: its bf16
    # tl.dot is wrong and so are its conversions to bf16 (int8 -> bf16 gives NaN, fp32 -> bf16
    # truncates), so there the weight tile stays fp32 (unrounded) and the dot runs in fp32; on the GPU
    # the tile is rounded to bf16 and multiplied on the tensor cores.
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


@triton.jit
def _int4_kernel(
    x_ptr, qw_ptr, s_ptr, m_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    in_m, in_n = rm < M, rn < N
    rw = tl.arange(0, BK // 8)  # the tile's words along K: each holds 8 consecutive K rows
    shifts = (tl.arange(0, 8) * 4)[None, :, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=in_m[:, None], other=0.0)
        words = tl.load(qw_ptr + (k0 // 8 + rw)[:, None] * N + rn[None, :], mask=in_n[None, :], other=0)
        # [BK / 8, 8, BN] -> [BK, BN]: row 8w + i is field i of word w. (An arithmetic shift of a
        # negative word smears the sign bit; the mask keeps the 4 bits.)
        codes = tl.reshape((words[:, None, :] >> shifts) & 0xF, (BK, BN))
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + rn, mask=in_n, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + g * N + rn, mask=in_n, other=0.0).to(tl.float32)
        w = codes.to(tl.float32) * s[None, :] + mn[None, :]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=in_m[:, None] & in_n[None, :],
    )


@triton.jit
def _int8_kernel(
    x_ptr, qw_ptr, s_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    in_m, in_n = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        in_k = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        q = tl.load(qw_ptr + (k0 + rk)[:, None] * N + rn[None, :], mask=in_k[:, None] & in_n[None, :], other=0)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, q.to(x.dtype))  # |code| <= 127: exact in fp16 / bf16
    acc *= tl.load(s_ptr + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=in_m[:, None] & in_n[None, :],
    )


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quantized matmul: input of shape {tuple(x.shape)}, expected [rows, {k}]")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"quantized matmul: activations must be fp32, fp16 or bf16, got {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) @ the packed int4 weight^T (+ bias) -> [M, N] in x's dtype."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    x = _rows(x, k)
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int4_kernel[grid](
        x, qweight, scales, mins, bias if bias is not None else y, y,
        x.shape[0], n, k, x.stride(0), y.stride(0),
        GROUP=group_size, HAS_BIAS=bias is not None, DOT_FP32=_dot_in_fp32(x.dtype),
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )  # fmt: skip
    return y


def int8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ (int8 qweight [K, N] * scales [N])^T (+ bias) -> [M, N] in x's dtype."""
    k, n = qweight.shape
    x = _rows(x, k)
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int8_kernel[grid](
        x, qweight, scales, bias if bias is not None else y, y,
        x.shape[0], n, k, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT_FP32=_dot_in_fp32(x.dtype),
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )  # fmt: skip
    return y
