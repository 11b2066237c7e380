"""Attention over a flattened token batch whose K/V live in a paged cache.

The batch is laid out decodes first, then prefill chunks. A decode is a sequence's last token,
possibly followed by draft tokens to verify (speculative decoding): a few queries at the end of
its context. Decodes are computed together as a grouped matmul + softmax over their gathered,
padded contexts, with their queries padded to the longest decode's; each prefill chunk is a causal grouped matmul + softmax over query tiles. Both beat
SDPA's CPU paths for these shapes (SDPA with a mask and grouped KV heads was ~5x slower per layer
for a chunk with cached context, see docs/scheduler.md).

On the CPU, the C++ kernels (kernels/csrc/attention.cpp) compute every sequence of the batch,
decodes and prefill chunks alike, straight from the block tables instead (the runner then fills
`seq_info` / `block_tables` rather than the gathered slots, masks and prefill spans), and write
K/V, an int8 / fp8 cache included (with its per-head scales).
"""


from __future__ import annotations

from dataclasses import dataclass

import torch

from tachyllm.kernels.kv_quant import QuantizedKV, kv_flat, kv_read, kv_write
from tachyllm.kernels.native import cpu_ops

# Queries per tile of a prefill chunk: bounds the fp32 score matrix to kv_heads x tile x group x context.
QUERY_TILE = 256


@dataclass
class PrefillSpan:
    start: int  # token range [start, end) of this chunk in the flattened batch
    end: int
    # Flat cache slots of the whole context (cached tokens + this chunk), or None when the chunk
    # is the sequence's entire context so far and can attend to its own fresh K/V directly.
    context_slots: torch.Tensor | None
    num_cached: int  # tokens of context before this chunk (its first query's position)
    # A long prompt prefilled in chunks keeps a contiguous head-major copy of its K/V
    # ([layers, 2, kv_heads, capacity, head_dim]) that each chunk appends to, so a chunk does not
    # gather its whole context from the paged cache in every layer. `buffer_filled` tokens of it
    # are valid before this chunk (fewer than num_cached when it starts after a prefix-cache hit).
    buffer: torch.Tensor | None = None
    buffer_filled: int = 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot where each token's K/V is written
    num_decode_tokens: int  # leading tokens of the batch that belong to decodes
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] flat slots (padding slots are masked)
    # [num_decodes, 1, queries, 1, max_context]: 0 where query j of a decode may see a context slot, else -inf
    decode_bias: torch.Tensor | None
    prefills: list[PrefillSpan]
    decode_queries: int = 1  # queries per decode after padding
    # When decodes have different numbers of queries: the batch row of each padded query
    # ([num_decodes * decode_queries]), and the padded row of each real decode token.
    decode_query_rows: torch.Tensor | None = None
    decode_output_rows: torch.Tensor | None = None
    # For the C++ kernel instead of the fields above, one row per sequence of the batch: int32
    # [num_seqs, 3] rows of (first batch row, number of queries, position of the first query),
    # and int32 block tables.
    seq_info: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


def runs_native(k_cache: torch.Tensor | QuantizedKV) -> bool:
    """Whether the C++ kernel computes attention over this cache (CPU; a quantized cache laid out
    in blocks): the caller then describes sequences by `seq_info` / `block_tables`."""
    if isinstance(k_cache, QuantizedKV):
        return k_cache.block_size is not None and cpu_ops(k_cache.data.device) is not None
    return cpu_ops(k_cache.device) is not None


def kernel_caches(
    k_cache: torch.Tensor | QuantizedKV, v_cache: torch.Tensor | QuantizedKV
) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
    """((K cache, K scales), (V cache, V scales)) as the C++ kernels take them; no scales for a plain cache."""
    if isinstance(k_cache, QuantizedKV):
        return k_cache.kernel_args(), v_cache.kernel_args()
    return (k_cache, None), (v_cache, None)


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor | QuantizedKV,  # [blocks, block_size, kv_heads, head_dim], or quantized storage
    v_cache: torch.Tensor | QuantizedKV,
    meta: AttentionMetadata,
    scale: float,
    layer: int = 0,
) -> torch.Tensor:
    head_dim = q.shape[2]
    num_kv_heads = k.shape[1]
    k_flat = kv_flat(k_cache, num_kv_heads, head_dim)
    v_flat = kv_flat(v_cache, num_kv_heads, head_dim)
    ops = cpu_ops(q.device) if runs_native(k_cache) else None
    if ops is not None:
        (kc, ks), (vc, vs) = kernel_caches(k_cache, v_cache)
        ops.write_kv(k, v, kc, vc, meta.slot_mapping, ks, vs)
    else:
        kv_write(k_flat, meta.slot_mapping, k)
        kv_write(v_flat, meta.slot_mapping, v)

    out = torch.empty_like(q)
    if meta.seq_info is not None:
        ops.paged_attention(out, q, kc, vc, meta.block_tables, meta.seq_info, scale, ks, vs)
        return out
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode_attention(q, k_flat, v_flat, meta, num_kv_heads, scale)

    for span in meta.prefills:
        qs = q[span.start : span.end]
        if span.buffer is not None:
            kh, vh = _append_to_buffer(span, layer, k, v, k_flat, v_flat)
            out[span.start : span.end] = _causal_head_major(qs, kh, vh, span.num_cached, scale)
            continue
        if span.context_slots is None:
            ks, vs = k[span.start : span.end], v[span.start : span.end]
        else:
            ks = kv_read(k_flat, span.context_slots, q.dtype)
            vs = kv_read(v_flat, span.context_slots, q.dtype)
        out[span.start : span.end] = causal_attention(qs, ks, vs, span.num_cached, scale)
    return out


def _append_to_buffer(
    span: PrefillSpan, layer: int, k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes this chunk's K/V (and, the first time, the cached context) into the sequence's
    contiguous buffer; returns head-major views of its whole context."""
    kb, vb = span.buffer[layer, 0], span.buffer[layer, 1]
    end = span.num_cached + span.end - span.start
    if span.buffer_filled < span.num_cached:
        slots = span.context_slots[span.buffer_filled : span.num_cached]
        kb[:, span.buffer_filled : span.num_cached] = k_flat[slots].transpose(0, 1)
        vb[:, span.buffer_filled : span.num_cached] = v_flat[slots].transpose(0, 1)
    kb[:, span.num_cached : end] = k[span.start : span.end].transpose(0, 1)
    vb[:, span.num_cached : end] = v[span.start : span.end].transpose(0, 1)
    return kb[:, :end], vb[:, :end]


def _decode_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor | QuantizedKV,
    v_flat: torch.Tensor | QuantizedKV,
    meta: AttentionMetadata,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    batch, queries = meta.decode_slots.shape[0], meta.decode_queries
    # Head-major copies ([B, kvh, T, hd]) make both matmuls run on contiguous matrices (~2x faster).
    kc = kv_read(k_flat, meta.decode_slots, q.dtype).transpose(1, 2).contiguous()
    vc = kv_read(v_flat, meta.decode_slots, q.dtype).transpose(1, 2).contiguous()
    qd = q[: meta.num_decode_tokens] if meta.decode_query_rows is None else q.index_select(0, meta.decode_query_rows)
    # Query head h reads KV head h // group, so heads are grouped kv-major; a decode's queries and
    # groups share one matrix row range. Scaling the few query values is cheaper than the scores.
    qd = qd.view(batch, queries, num_kv_heads, group, head_dim)
    if queries > 1:
        qd = qd.transpose(1, 2)
    qd = qd.reshape(batch, num_kv_heads, queries * group, head_dim) * scale
    scores = torch.matmul(qd, kc.transpose(2, 3)).float()  # [B, kvh, queries * group, T]
    scores = scores.view(batch, num_kv_heads, queries, group, -1) + meta.decode_bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(batch, num_kv_heads, queries * group, -1)
    o = torch.matmul(probs, vc).view(batch, num_kv_heads, queries, group, head_dim)
    if queries > 1:
        o = o.transpose(1, 2)
    o = o.reshape(batch * queries, num_heads, head_dim)
    return o if meta.decode_output_rows is None else o.index_select(0, meta.decode_output_rows)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """q: [L, heads, hd] at positions num_cached .. num_cached + L - 1; k, v: [num_cached + L, kv_heads, hd].
    Query i sees keys j <= num_cached + i. Each query tile reads only the keys it can see."""
    # [kvh, T, hd]: contiguous matrices for the matmuls
    return _causal_head_major(q, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), num_cached, scale)


def _causal_head_major(q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """causal_attention with K/V given head-major: kh, vh [kv_heads, num_cached + L, hd]."""
    length, num_heads, head_dim = q.shape
    num_kv_heads = kh.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i0 in range(0, length, QUERY_TILE):
        i1 = min(i0 + QUERY_TILE, length)
        rows, first, visible = (i1 - i0) * group, num_cached + i0, num_cached + i1
        # Rows ordered (query, group) so that row r is query i0 + r // group of its KV head.
        qt = q[i0:i1].view(i1 - i0, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, rows, head_dim)
        scores = torch.matmul(qt * scale, kh[:, :visible].transpose(1, 2)).float()  # [kvh, rows, visible]
        # Keys before the tile's first query are visible to all its rows: only the tail needs a mask.
        positions = torch.arange(first, visible, device=q.device).repeat_interleave(group)
        future = torch.arange(first, visible, device=q.device).unsqueeze(0) > positions.unsqueeze(1)
        scores[..., first:].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, vh[:, :visible])  # [kvh, rows, hd]
        out[i0:i1] = o.view(num_kv_heads, i1 - i0, group, head_dim).transpose(0, 1).reshape(i1 - i0, num_heads, head_dim)
    return out
