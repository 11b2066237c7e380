"""Attention over a flattened token batch whose K/V live in a paged cache.

The batch is laid out decodes first (one query token per sequence), then prefill chunks.
Decodes are computed together as a grouped matmul + softmax over their gathered, padded
contexts; each prefill chunk is a causal grouped matmul + softmax over query tiles. Both beat
SDPA's CPU paths for these shapes (SDPA with a mask and grouped KV heads was ~5x slower per layer
for a chunk with cached context, see docs/scheduler.md).
"""


from __future__ import annotations

from dataclasses import dataclass

import torch

from tachyllm.kernels.kv_quant import QuantizedKV, kv_flat, kv_read, kv_write

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


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot where each token's K/V is written
    num_decode_tokens: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] flat slots (padding slots are masked)
    decode_bias: torch.Tensor | None  # [num_decodes, 1, 1, max_context] 0 or -inf
    prefills: list[PrefillSpan]


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor | QuantizedKV,  # [blocks, block_size, kv_heads, head_dim], or quantized storage
    v_cache: torch.Tensor | QuantizedKV,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    k_flat = kv_flat(k_cache, num_kv_heads, head_dim)
    v_flat = kv_flat(v_cache, num_kv_heads, head_dim)
    kv_write(k_flat, meta.slot_mapping, k)
    kv_write(v_flat, meta.slot_mapping, v)

    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        group = num_heads // num_kv_heads
        # Head-major copies ([B, kvh, T, hd]) make both matmuls run on contiguous matrices (~2x faster).
        kc = kv_read(k_flat, meta.decode_slots, q.dtype).transpose(1, 2).contiguous()
        vc = kv_read(v_flat, meta.decode_slots, q.dtype).transpose(1, 2).contiguous()
        # Query head h reads KV head h // group, so heads are grouped kv-major.
        # Scaling the few query values is cheaper than scaling the score matrix.
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim) * scale
        scores = torch.matmul(qd, kc.transpose(2, 3)).float()  # [B, kvh, group, T]
        probs = torch.softmax(scores + meta.decode_bias, dim=-1).to(q.dtype)
        out[:nd] = torch.matmul(probs, vc).view(nd, num_heads, head_dim)

    for span in meta.prefills:
        if span.context_slots is None:
            ks, vs = k[span.start : span.end], v[span.start : span.end]
        else:
            ks = kv_read(k_flat, span.context_slots, q.dtype)
            vs = kv_read(v_flat, span.context_slots, q.dtype)
        out[span.start : span.end] = causal_attention(q[span.start : span.end], ks, vs, span.num_cached, scale)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """q: [L, heads, hd] at positions num_cached .. num_cached + L - 1; k, v: [num_cached + L, kv_heads, hd].
    Query i sees keys j <= num_cached + i. Each query tile reads only the keys it can see."""
    length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    kh = k.transpose(0, 1).contiguous()  # [kvh, T, hd]: contiguous matrices for the matmuls
    vh = v.transpose(0, 1).contiguous()
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
