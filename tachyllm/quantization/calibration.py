"""Shipped text sets and a teacher-forced forward pass, shared by AWQ, KV-scale calibration and the
quality report. A window is one sequence computed in one step (sequence_batch), outside the scheduler."""

from __future__ import annotations

from importlib import resources

import torch
from torch import nn

from tachyllm.backends.base import LayerKV
from tachyllm.backends.torch_backend import TorchBackend
from tachyllm.quantization.model_parts import model_config, norm_weight, rotary_positions
from tachyllm.sampling_params import SamplingParams
from tachyllm.step import SamplingInput, ScheduledSeq, StepBatch

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
    seq_len = min(seq_len, rotary_positions(model))
    return token_windows(tokenizer, load_text(CALIBRATION_FILE), seq_len, max_windows)


def sequence_batch(token_ids: list[int], block_size: int) -> StepBatch:
    """A whole window as one step: its every position computed, K/V in cache slots 0..n-1."""
    n = len(token_ids)
    seq = ScheduledSeq(
        seq_id=0, request_id="teacher-forced", start=0, token_ids=token_ids, num_draft_tokens=0,
        block_table=list(range(-(-n // block_size))), seq_len=n, completes=True,
        sampling=SamplingInput(SamplingParams(), token_ids, n),
    )  # fmt: skip
    return StepBatch([seq])


def scratch_kv_caches(model: nn.Module, num_tokens: int) -> list[LayerKV]:
    """Plain model-dtype caches of one num_tokens block per layer."""
    w = norm_weight(model)
    return TorchBackend(w.device).allocate_kv_cache(model_config(model), 1, num_tokens, w.dtype)


@torch.inference_mode()
def forward_sequence(model: nn.Module, token_ids: list[int], kv_caches: list[LayerKV]) -> torch.Tensor:
    """Final hidden states [n, hidden] of one sequence written to scratch caches (scratch_kv_caches).

    It runs the portable backend's step whatever backend the model was built for: attention over
    the fresh K/V in the Python modules, so that calibration hooks on them see every layer.
    """
    w = norm_weight(model)
    k_cache = kv_caches[0][0]
    assert isinstance(k_cache, torch.Tensor), "scratch caches are plain"
    block_size = k_cache.shape[1]
    builder = TorchBackend(w.device).metadata_builder(kv_caches, block_size)
    input_ids, positions, meta = builder.prepare(sequence_batch(token_ids, block_size))
    hidden: torch.Tensor = model(input_ids, positions, kv_caches, meta)
    return hidden


def next_token_kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) in nats at each position, from log-probabilities [n, vocab]."""
    return (reference.exp() * (reference - other)).sum(dim=-1)
