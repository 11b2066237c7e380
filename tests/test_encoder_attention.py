"""An encoder step's attention on the CPU backend (kernels/csrc/encoder_attention.cpp): each packed input
attends to itself bidirectionally, read where it lies, unpadded; against a plain per-input reference and
the portable backend's padded SDPA, and refusing malformed inputs (its batch invariance:
tests/test_batch_invariance.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.lora_kernels import seqs

from tachyllm.backends.base import ENCODER_STEP_ROW_MULTIPLE
from tachyllm.backends.cpu_backend import CpuBackend
from tachyllm.backends.torch_backend import TorchBackend
from tachyllm.kernels import native
from tachyllm.step import StepBatch

ops = native.native_ops()
pytestmark = pytest.mark.native

HEADS, HEAD_DIM = 3, 32
# Lengths around the kernel's 16-key vectors, a lone token and one input longer than the rest together.
LENGTHS = [5, 1, 16, 17, 40, 3, 130]


def packed_qkv(lengths: list[int], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one fused [rows, 3 * heads * head_dim] projection, as the model has them, with
    the step's padding rows after the inputs."""
    rows = sum(lengths) + (-sum(lengths) % ENCODER_STEP_ROW_MULTIPLE)
    qkv = torch.randn(rows, 3 * HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return tuple(qkv.view(rows, 3, HEADS, HEAD_DIM).unbind(1))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Plain fp64 softmax attention of each input over itself, [tokens of the inputs, heads, head_dim]."""
    outputs, first = [], 0
    for n in lengths:
        qi, ki, vi = (t[first : first + n].double().transpose(0, 1) for t in (q, k, v))
        weights = torch.softmax(qi @ ki.transpose(1, 2) / math.sqrt(HEAD_DIM), dim=-1)
        outputs.append((weights @ vi).transpose(0, 1))
        first += n
    return torch.cat(outputs)


def encoder_step(backend, lengths: list[int]):
    return backend.prepare_encoder(StepBatch(seqs([(0, n) for n in lengths])))[3]


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_encoder_attention_matches_a_reference_and_the_portable_backend(dtype, tolerance):
    cpu, portable = CpuBackend(torch.device("cpu")), TorchBackend(torch.device("cpu"))
    q, k, v = packed_qkv(LENGTHS, dtype)
    scale = HEAD_DIM**-0.5
    got = cpu.encoder_attention(q, k, v, encoder_step(cpu, LENGTHS), scale)
    assert got.shape == q.shape and got.dtype == dtype
    tokens = sum(LENGTHS)
    torch.testing.assert_close(got[:tokens].double(), reference(q, k, v, LENGTHS), rtol=tolerance, atol=tolerance)
    assert not got[tokens:].any()  # the step's padding rows: zeros, not garbage
    padded = portable.encoder_attention(q, k, v, encoder_step(portable, LENGTHS), scale)
    torch.testing.assert_close(got[:tokens], padded[:tokens], rtol=tolerance, atol=tolerance)


def test_malformed_encoder_attention_inputs_are_refused():
    q, k, v = packed_qkv([4, 4], torch.float32)
    out = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match="seq_starts must run from 0"):
        ops.encoder_attention(out, q, k, v, torch.tensor([1, 8]), 1.0)
    with pytest.raises(RuntimeError, match="seq_starts must run from 0"):
        ops.encoder_attention(out, q, k, v, torch.tensor([0, q.shape[0] + 1]), 1.0)
    with pytest.raises(RuntimeError, match="every input must have a token"):
        ops.encoder_attention(out, q, k, v, torch.tensor([0, 4, 4, 8]), 1.0)
    with pytest.raises(RuntimeError, match="seq_starts must be a contiguous int64"):
        ops.encoder_attention(out, q, k, v, torch.tensor([0, 4, 8], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="k must have q's dtype"):
        ops.encoder_attention(out, q, k.bfloat16(), v, torch.tensor([0, 4, 8]), 1.0)
    with pytest.raises(RuntimeError, match="v must be"):
        ops.encoder_attention(out, q, k, v[:4], torch.tensor([0, 4, 8]), 1.0)
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        strided = torch.randn(q.shape[0], HEAD_DIM, HEADS).transpose(1, 2)  # q's shape, a head's values apart
        ops.encoder_attention(out, q, k, strided, torch.tensor([0, 4, 8]), 1.0)
