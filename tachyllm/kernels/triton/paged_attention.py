"""Paged attention and the KV-cache write in Triton, straight from block tables.

One kernel computes every sequence of a step: a decode (one query at the end of its context), a
speculative verification (a few), a prefill chunk (from position 0 or after cached context). A
program takes one tile of BLOCK_Q consecutive queries of one sequence and one KV head; its rows are
(query, query head of that KV head's group), so GQA/MQA heads share every K/V load. Keys are walked
in tiles of KEY_TILE positions aligned to absolute positions, gathered through the block table, with
an online softmax. Quantized caches (int8, fp8 e4m3 / e5m2) are read in place and multiplied by
their per-head scale, as kv_quant.QuantizedKV.read does.

Batch invariance (docs/determinism.md): a sequence's query tiles start at its first query and the
key tiles at multiples of KEY_TILE, so a row meets the same tiles whatever else is in the batch.
Long contexts are cut into segments at fixed multiples of `segment` positions (flash-decoding);
segments are merged in position order with one formula (`_merge_weights`), and a row whose visible
keys lie in one segment is normalised straight from it. Whether the segments of a tile run as
parallel programs (then a second kernel merges them) or one after another in one program is chosen
from the step's size, and gives the same bits: key tiles or segments that hold no key a row sees add
exact zeros to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyllm.kernels.kv_quant import qmax

# Positions per split-KV segment: long contexts are cut at multiples of this (like the C++ kernel).
SEGMENT = 512
# Keys per inner-loop tile; a segment is a whole number of them.
KEY_TILE = 32
# Rows (query x query head) per program: the smallest tile tl.dot takes.
MIN_ROWS = 16
# The split (parallel) segment programs keep fp32 partial results per (token, head, segment); above
# this many bytes of them a step runs each tile's segments in one program instead (same results).
SPLIT_PARTIALS_BYTES = 64 << 20
# Values per KV-write program: whole tokens, (KV head, dimension) pairs of one or several.
WRITE_TILE = 4096
LOG2E = 1.4426950408889634  # scores are kept in log2 units: exp2 is the cheap exponential

# kv_quant.KV_STORAGE dtype -> (QUANT code, fp8 mantissa bits, fp8 smallest normal exponent)
_QUANT = {
    torch.int8: (1, 0, 0),
    torch.float8_e4m3fn: (2, 3, -6),
    torch.float8_e5m2: (2, 2, -14),
}


# -- the KV write ------------------------------------------------------------------------------
@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _round_to_fp8(y, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """y rounded (half to even) to the nearest fp8 value, in fp32, so that the final cast is exact
    (Triton's interpreter casts wrongly where rounding carries into the exponent)."""
    exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, MIN_EXP) - MANTISSA  # the exponent of one unit in the last place
    ulp = ((exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - exp) << 23).to(tl.float32, bitcast=True)
    rounded = _round_half_even(y * inv_ulp) * ulp
    return tl.where(rounded == 0.0, y * 0.0, rounded)  # a negative value that rounds to 0 keeps its sign: -0


@triton.jit
def _store_kv(src, dst, scale, heads, heads_ok, mask, QUANT: tl.constexpr, QMAX: tl.constexpr, MANTISSA: tl.constexpr,
              MIN_EXP: tl.constexpr):  # fmt: skip
    x = tl.load(src, mask=mask, other=0.0)
    if QUANT == 0:
        y = x
    else:
        # As QuantizedKV.write: divide by the head's scale, saturate, round.
        y = tl.math.div_rn(x.to(tl.float32), tl.load(scale + heads, mask=heads_ok, other=1.0))
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if QUANT == 1:
            y = _round_half_even(y)
        else:
            y = _round_to_fp8(y, MANTISSA, MIN_EXP)
    tl.store(dst, y.to(dst.dtype.element_ty), mask=mask)


# Integers that change from step to step are not specialised on (== 1, multiples of 16): one
# compiled variant serves every step instead of a compile at the first step of each kind.
@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    num_tokens, num_kv_heads, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, HEADS_P2: tl.constexpr, BLOCK_T: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    # Rows: BLOCK_T tokens; columns: (KV head, dimension) pairs.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    c = tl.arange(0, HEADS_P2 * HEAD_P2)[None, :]
    h = c // HEAD_P2
    d = c % HEAD_P2
    slot = tl.load(slot_mapping + t, mask=t < num_tokens, other=-1)
    # A negative slot is a padding row of a CUDA graph.
    mask = (slot >= 0) & (h < num_kv_heads) & (d < HEAD_DIM)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + h * stride_ch + d
    heads_ok = h < num_kv_heads
    _store_kv(k + t * stride_kt + h * stride_kh + d, k_cache + dst, k_scale, h, heads_ok, mask, QUANT, QMAX, MANTISSA,
              MIN_EXP)  # fmt: skip
    _store_kv(v + t * stride_vt + h * stride_vh + d, v_cache + dst, v_scale, h, heads_ok, mask, QUANT, QMAX, MANTISSA,
              MIN_EXP)  # fmt: skip


def write_kv(
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim], storage dtype
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [tokens]; a negative slot is skipped
    k_scale: torch.Tensor | None = None,  # fp32 [kv_heads], for int8 / fp8 caches
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes each token's K/V into its cache slot, quantized for an int8 / fp8 cache exactly as
    kv_quant.QuantizedKV.write does."""
    tokens, kv_heads, head_dim = k.shape
    _check_cache(k_cache, v_cache, kv_heads, head_dim, k_scale, v_scale)
    if v.shape != k.shape or slot_mapping.shape != (tokens,):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping {tuple(slot_mapping.shape)} differ")
    if tokens == 0:
        return
    quant, mantissa, min_exp = _QUANT.get(k_cache.dtype, (0, 0, 0))
    limit = qmax(k_cache.dtype) if quant else 0.0
    head_p2, heads_p2 = triton.next_power_of_2(head_dim), triton.next_power_of_2(kv_heads)
    block_t = max(1, WRITE_TILE // (head_p2 * heads_p2))
    _write_kv_kernel[(triton.cdiv(tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        tokens, kv_heads, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_P2=head_p2, HEADS_P2=heads_p2, BLOCK_T=block_t,
        QUANT=quant, QMAX=limit, MANTISSA=mantissa, MIN_EXP=min_exp,
    )  # fmt: skip


# -- attention ---------------------------------------------------------------------------------
@triton.jit
def _merge_weights(M, m):
    """Running max M and a segment's max m -> (weight of the running sums, weight of the segment's,
    new max); -inf maxima (nothing seen yet, or nothing to see) weigh 0."""
    new = tl.maximum(M, m)
    safe = tl.where(new == float("-inf"), 0.0, new)
    return tl.exp2(M - safe), tl.exp2(m - safe), new


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _segment(
    qv, pos, row_lo, k_cache, v_cache, table, ks, vs, kvh, block_size, scale_log2, lo, hi,
    stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [lo, hi) (lo a multiple of BLOCK_N) for rows at positions `pos`
    that see keys [row_lo, pos]: (unnormalised output, running max in log2 units, sum of weights)."""
    d = tl.arange(0, HEAD_P2)
    d_ok = d < HEAD_DIM
    acc = tl.zeros([BLOCK_M, HEAD_P2], dtype=tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        block = tl.load(table + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        offs = block * stride_cb + (kpos % block_size) * stride_cs + kvh * stride_ch
        kv_mask = k_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        vt = tl.load(v_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT:  # dequantized to the query's dtype, as the PyTorch path reads a quantized cache
            kt = (kt.to(tl.float32) * ks).to(qv.dtype)
            vt = (vt.to(tl.float32) * vs).to(qv.dtype)
        s = _dot(qv, tl.trans(kt), DOT_FP32) * scale_log2
        seen = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= row_lo[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: everything weighs 0
        alpha = tl.exp2(m - safe)
        p = tl.exp2(s - safe[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, DOT_FP32)
        m = m_new
    return acc, m, lsum


@triton.jit
def _find_seq(query_start, num_seqs, index, BLOCK_Q: tl.constexpr):
    """Binary search: the last sequence s whose first query tile, query_start[s] // BLOCK_Q + s, is
    <= index; with BLOCK_Q == 0, the last s with query_start[s] <= index (the owner of token index)."""
    # Tensors from the start: num_seqs == 1 arrives as a compile-time constant.
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start + mid)
        if BLOCK_Q > 0:
            first = first // BLOCK_Q + mid
        ok = first <= index
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["window", "num_seqs", "num_parts", "stride_bt"])
def _attention_kernel(
    out, q, k_cache, v_cache, block_tables, query_start, seq_lens, k_scale, v_scale, part_acc, part_ml,
    scale_log2, window, num_seqs, block_size, num_heads, num_parts,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr,
    QUANT: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # Sequence s owns tiles query_start[s] // BLOCK_Q + s onwards (ranges that never overlap; the
    # grid has enough for any batch of this many tokens and sequences; spare ones exit here).
    seq = _find_seq(query_start, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(query_start + seq)
    n = tl.load(query_start + seq + 1) - q_begin
    local = tile - (q_begin // BLOCK_Q + seq)
    if local * BLOCK_Q >= n:
        return
    seq_len = tl.load(seq_lens + seq)
    tile_first = seq_len - n + local * BLOCK_Q  # the position of the tile's first query
    tile_end = tl.minimum(tile_first + BLOCK_Q, seq_len)

    r = tl.arange(0, BLOCK_M)
    qi = local * BLOCK_Q + r // GROUP_P2
    g = r % GROUP_P2
    row_ok = (qi < n) & (g < GROUP)
    token = q_begin + qi
    head = kvh * GROUP + g
    pos = seq_len - n + qi
    row_lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    d = tl.arange(0, HEAD_P2)
    io_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    qv = tl.load(q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    ks = 1.0
    vs = 1.0
    if QUANT:
        ks = tl.load(k_scale + kvh)
        vs = tl.load(v_scale + kvh)
    table = block_tables + seq.to(tl.int64) * stride_bt

    # Keys of the tile: from its first query's window start (aligned down to a key tile) to its last query.
    key_lo = tl.where(window > 0, tl.maximum(tile_first - window + 1, 0), 0) // BLOCK_N * BLOCK_N
    seg_lo = key_lo // SEGMENT
    seg_hi = (tile_end - 1) // SEGMENT
    # A row's own segments: those holding the keys it sees.
    row_seg_lo = row_lo // SEGMENT
    row_seg_hi = pos // SEGMENT
    out_ptr = out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:
        seg = seg_lo + tl.program_id(2)
        if seg > seg_hi:
            return
        lo = tl.maximum(seg * SEGMENT, key_lo)
        hi = tl.minimum((seg + 1) * SEGMENT, tile_end)
        acc, m, lsum = _segment(
            qv, pos, row_lo, k_cache, v_cache, table, ks, vs, kvh, block_size, scale_log2, lo, hi,
            stride_cb, stride_cs, stride_ch, HEAD_DIM, HEAD_P2, BLOCK_M, BLOCK_N, QUANT, DOT_FP32,
        )  # fmt: skip
        # A row with one segment is normalised here, as the merge of that one segment would be.
        alone = row_ok & (row_seg_lo == seg) & (row_seg_hi == seg)
        tl.store(out_ptr, (acc / lsum[:, None]).to(out.dtype.element_ty), mask=io_mask & alone[:, None])
        # Rows with several segments leave this one's partial results to _merge_kernel.
        part = row_ok & (row_seg_lo < row_seg_hi) & (row_seg_lo <= seg) & (seg <= row_seg_hi)
        p_row = (token * num_heads + head) * num_parts + seg
        tl.store(part_acc + p_row[:, None] * HEAD_P2 + d[None, :], acc, mask=io_mask & part[:, None])
        tl.store(part_ml + p_row * 2, m, mask=part)
        tl.store(part_ml + p_row * 2 + 1, lsum, mask=part)
    else:
        total = tl.zeros([BLOCK_M, HEAD_P2], dtype=tl.float32)
        M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        L = tl.zeros([BLOCK_M], dtype=tl.float32)
        for seg in range(seg_lo, seg_hi + 1):
            lo = tl.maximum(seg * SEGMENT, key_lo)
            hi = tl.minimum((seg + 1) * SEGMENT, tile_end)
            acc, m, lsum = _segment(
                qv, pos, row_lo, k_cache, v_cache, table, ks, vs, kvh, block_size, scale_log2, lo, hi,
                stride_cb, stride_cs, stride_ch, HEAD_DIM, HEAD_P2, BLOCK_M, BLOCK_N, QUANT, DOT_FP32,
            )  # fmt: skip
            alpha, beta, M = _merge_weights(M, m)
            total = total * alpha[:, None] + acc * beta[:, None]
            L = L * alpha + lsum * beta
        tl.store(out_ptr, (total / L[:, None]).to(out.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["window", "num_seqs", "num_parts"])
def _merge_kernel(
    out, part_acc, part_ml, query_start, seq_lens, window, num_seqs, num_heads, num_parts, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, SEGMENT: tl.constexpr,
):  # fmt: skip
    """One (token, head) row with several segments: their partial results merged in position order,
    with the formula of the single-program path."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start + num_seqs):  # a padding row of a CUDA graph
        return
    seq = _find_seq(query_start, num_seqs, token, 0)
    q_begin = tl.load(query_start + seq)
    n = tl.load(query_start + seq + 1) - q_begin
    pos = tl.load(seq_lens + seq) - n + token - q_begin
    seg_lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0) // SEGMENT
    seg_hi = pos // SEGMENT
    if seg_lo == seg_hi:  # normalised by the attention kernel
        return
    d = tl.arange(0, HEAD_P2)
    total = tl.zeros([HEAD_P2], dtype=tl.float32)
    M = tl.full([], float("-inf"), dtype=tl.float32)
    L = tl.zeros([], dtype=tl.float32)
    for seg in range(seg_lo, seg_hi + 1):
        p_row = (token * num_heads + head) * num_parts + seg
        acc = tl.load(part_acc + p_row * HEAD_P2 + d)
        m = tl.load(part_ml + p_row * 2)
        lsum = tl.load(part_ml + p_row * 2 + 1)
        alpha, beta, M = _merge_weights(M, m)
        total = total * alpha + acc * beta
        L = L * alpha + lsum * beta
    tl.store(out + token * stride_ot + head * stride_oh + d, (total / L).to(out.dtype.element_ty), mask=d < HEAD_DIM)


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim], storage dtype
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [seqs, max_blocks]
    query_start: torch.Tensor,  # int32 [seqs + 1]: the rows of q of sequence s are query_start[s] .. [s + 1] - 1
    seq_lens: torch.Tensor,  # int32 [seqs]: context length including this step's queries
    scale: float,
    *,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,  # fp32 [kv_heads], for int8 / fp8 caches
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    segment: int = SEGMENT,
) -> torch.Tensor:
    """Attention of every query over its sequence's cached context (this step's K/V written first:
    write_kv). Query i of sequence s sits at position seq_lens[s] - n_s + i and sees positions up to
    its own (with a `window`, only the last `window` of them; key tiles wholly before a query tile's
    windows are not read). A sequence with no queries (a CUDA graph's padding) reads nothing, and
    rows of q past query_start[-1] are left as they are in `out`. No host synchronisation: the grid
    follows the tensors' shapes only. `segment` (a multiple of KEY_TILE) exists for tests."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    _check_cache(k_cache, v_cache, kv_heads, head_dim, k_scale, v_scale)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    if segment % KEY_TILE:
        raise ValueError(f"segment must be a multiple of {KEY_TILE}, got {segment}")
    num_seqs = seq_lens.shape[0]
    if query_start.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start {tuple(query_start.shape)} and block_tables {tuple(block_tables.shape)} "
            f"do not fit {num_seqs} sequences"
        )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0 or num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    group = heads // kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_q = max(1, MIN_ROWS // group_p2)
    head_p2 = triton.next_power_of_2(head_dim)
    # Segments a row can span, from the block tables' width (not their contents: no sync).
    num_parts = triton.cdiv(block_tables.shape[1] * block_size, segment)
    split = num_parts > 1 and tokens * heads * num_parts * head_p2 * 4 <= SPLIT_PARTIALS_BYTES
    if split:
        part_acc = torch.empty(tokens * heads * num_parts * head_p2, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(tokens * heads * num_parts * 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # not read
    # bf16 tl.dot is wrong in Triton's interpreter (CPU tensors): it runs on fp32 tiles there.
    dot_fp32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and q.device.type == "cpu")
    window = window or 0
    grid = (tokens // block_q + num_seqs, kv_heads, num_parts if split else 1)
    _attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start, seq_lens, k_scale, v_scale, part_acc, part_ml,
        scale * LOG2E, window, num_seqs, block_size, heads, num_parts,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_P2=head_p2, GROUP=group, GROUP_P2=group_p2, BLOCK_Q=block_q, BLOCK_N=KEY_TILE,
        SEGMENT=segment, QUANT=k_scale is not None, SPLIT=split, DOT_FP32=dot_fp32,
    )  # fmt: skip
    if split:
        _merge_kernel[(tokens, heads)](
            out, part_acc, part_ml, query_start, seq_lens, window, num_seqs, heads, num_parts,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, HEAD_P2=head_p2, SEGMENT=segment,
        )  # fmt: skip
    return out


def _check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    if k_cache.dim() != 4 or k_cache.shape[2:] != (kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
            f"are not [blocks, block_size, {kv_heads}, {head_dim}]"
        )
    if v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("the K and V caches must have one layout and dtype")
    quantized = k_cache.dtype in _QUANT
    if quantized != (k_scale is not None and v_scale is not None):
        raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale" if quantized
                         else f"scales given for a {k_cache.dtype} cache")  # fmt: skip
    if (
        quantized
        and k_scale is not None
        and v_scale is not None
        and (k_scale.shape != (kv_heads,) or v_scale.shape != (kv_heads,))
    ):
        raise ValueError(f"k_scale / v_scale must be fp32 [{kv_heads}]")
