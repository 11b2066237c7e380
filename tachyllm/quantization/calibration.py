"""Shipped text sets and a teacher-forced forward pass, shared by AWQ, KV-scale calibration and the
quality report. The pass is one prefill span over a scratch KV cache, outside the scheduler."""

from __future__ import annotations

from importlib import resources

import torch
from torch import nn

from tachyllm.kernels.paged_attention import AttentionMetadata, PrefillSpan, kernel_caches, runs_native

CALIBRATION_FILE = "calibration.txt"
HELDOUT_FILE = "heldout.txt"


def load_text(name: str) -> str:
    return resources.files("tachyllm.data").joinpath(name).read_text(encoding="utf-8")


def token_windows(tokenizer, text: str, seq_len: int, max_windows: int | None = None) -> list[list[int]]:
    """Cuts the tokenized text into consecutive windows of seq_len tokens (the short tail is dropped)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    windows = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    return windows[:max_windows] if max_windows is not None else windows


def calibration_windows(model: nn.Module, tokenizer, seq_len: int, max_windows: int) -> list[list[int]]:
    """Windows of the calibration text, no longer than the model's rotary table allows."""
    seq_len = min(seq_len, model.rotary.cos.shape[0])
    return token_windows(tokenizer, load_text(CALIBRATION_FILE), seq_len, max_windows)


def scratch_kv_caches(model: nn.Module, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain model-dtype caches shaped [1, num_tokens, kv_heads, head_dim] per layer."""
    cfg = model.config
    w = model.embed_tokens.weight
    shape = (1, num_tokens, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=w.dtype, device=w.device), torch.zeros(shape, dtype=w.dtype, device=w.device)) for _ in range(cfg.num_layers)]


@torch.inference_mode()
def forward_sequence(model: nn.Module, token_ids: list[int], kv_caches, read_cache: bool = False) -> torch.Tensor:
    """Final hidden states [n, hidden] of one sequence written to cache slots 0..n-1.

    read_cache=True computes the step as the engine does: attention reads K/V back from the cache
    (so a quantized cache's rounding is part of the result), in the C++ kernel where the engine
    uses it (the quality report). False attends to the fresh K/V through the Python modules, so
    that calibration hooks on them see every layer.
    """
    device = model.embed_tokens.weight.device
    n = len(token_ids)
    slots = torch.arange(n, device=device)
    span = PrefillSpan(0, n, slots if read_cache else None, 0)
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=0, decode_slots=None, decode_bias=None, prefills=[span])
    if read_cache and runs_native(kv_caches[0][0]):
        (paged_k, _), _ = kernel_caches(*kv_caches[0])  # [blocks, block_size, kv_heads, head_dim]
        meta.seq_info = torch.tensor([[0, n, 0]], dtype=torch.int32)
        meta.block_tables = torch.arange(-(-n // paged_k.shape[1]), dtype=torch.int32).view(1, -1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    return model(ids, slots, kv_caches, meta)
