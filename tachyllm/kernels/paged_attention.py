"""Attention over a flattened token batch whose K/V live in a paged cache.

The batch is laid out decodes first (one query token per sequence), then prefill chunks.
Decodes are computed together as a grouped matmul + softmax over their gathered, padded
contexts (faster than SDPA's CPU decode path); each prefill chunk runs through SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # token range [start, end) of this chunk in the flattened batch
    end: int
    # Flat cache slots of the whole context (cached tokens + this chunk), or None when the chunk
    # is the sequence's entire context so far and can attend to its own fresh K/V directly.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [chunk, context] bool, True = may attend; None when context_slots is None


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
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))

    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        group = num_heads // num_kv_heads
        kc = k_flat[meta.decode_slots].to(q.dtype)  # [B, T, kvh, hd]
        vc = v_flat[meta.decode_slots].to(q.dtype)
        # Query head h reads KV head h // group, so heads are grouped kv-major.
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        scores = torch.matmul(qd, kc.permute(0, 2, 3, 1)).float() * scale  # [B, kvh, group, T]
        probs = torch.softmax(scores + meta.decode_bias, dim=-1).to(q.dtype)
        out[:nd] = torch.matmul(probs, vc.permute(0, 2, 1, 3)).view(nd, num_heads, head_dim)

    for span in meta.prefills:
        qs = q[span.start : span.end].transpose(0, 1)
        if span.context_slots is None:
            ks, vs = k[span.start : span.end], v[span.start : span.end]
        else:
            ks = k_flat[span.context_slots].to(q.dtype)
            vs = v_flat[span.context_slots].to(q.dtype)
        o = F.scaled_dot_product_attention(
            qs,
            ks.transpose(0, 1),
            vs.transpose(0, 1),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[span.start : span.end] = o.transpose(0, 1)
    return out
