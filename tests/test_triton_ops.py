"""The Triton elementwise ops (kernels/triton/fused_ops.py through backends/triton_ops.TritonOps) on
the CPU through Triton's interpreter, against the portable LayerOps: fp32 and fp16 to the last bit or
an fp32 ulp, bf16 within the interpreter's truncating bf16 conversion (one or two units in the last
place); rows independent of their batch; strided q / k views of a fused qkv output; a tiny model's
greedy tokens unchanged with TritonOps."""

from __future__ import annotations

import pytest
import torch

from tachyllm.backends import registry
from tachyllm.backends.base import PORTABLE_OPS
from tachyllm.backends.torch_backend import TorchBackend
from tachyllm.backends.triton_ops import TritonOps
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.eval.greedy import greedy_tokens

OPS = TritonOps()
# Compiled on a GPU where there is one, else in the interpreter on the CPU (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Largest |triton - portable| relative to the value plus 1 (the inputs' scale: rotary's differences
# cancel): fp32 / fp16 round where PyTorch rounds (fp32 reductions and exp may move an fp32 ulp);
# the interpreter's bf16 conversion truncates (up to 2 ulps of 2^-7 before a difference).
RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 2**-6}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs()
    assert (err <= RTOL[want.dtype] * (want.float().abs() + 1)).all(), f"{want.dtype}: max error {err.max()}"


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add(dtype):
    x, r = _randn(5, 96, dtype=dtype), _randn(5, 96, dtype=dtype, seed=1)
    w = 1 + _randn(96, dtype=dtype, seed=2, scale=0.1)
    _close(OPS.rms_norm(x, w, 1e-6), PORTABLE_OPS.rms_norm(x, w, 1e-6))
    # q / k norms (Qwen3) normalise each head of a [tokens, heads, head_dim] tensor.
    heads = _randn(3, 4, 32, dtype=dtype, seed=3)
    _close(OPS.rms_norm(heads, w[:32], 1e-6), PORTABLE_OPS.rms_norm(heads, w[:32], 1e-6))
    normed, total = OPS.add_rms_norm(x, r, w, 1e-6)
    want_normed, want_total = PORTABLE_OPS.add_rms_norm(x, r, w, 1e-6)
    _close(normed, want_normed)
    assert torch.equal(total, want_total) or dtype == torch.bfloat16  # the sum is one rounding
    _close(total, want_total)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_of_strided_q_and_k_in_one_launch(dtype):
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 16
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # views of the fused projection
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.outer(torch.arange(50, dtype=torch.float32), torch.rand(head_dim // 2) + 0.1)
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 49, 2, 2, 7, 1], device=DEVICE)
    got, want = OPS.rotary(positions, q, k, cos, sin), PORTABLE_OPS.rotary(positions, q, k, cos, sin)
    for g, w in zip(got, want):
        _close(g, w)
    with pytest.raises(ValueError, match=r"cos / sin must be contiguous \[positions, 8\]"):
        OPS.rotary(positions, q, k, cos[:, :4], sin[:, :4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations(dtype):
    gate_up = _randn(3, 2, 80, dtype=dtype, scale=3.0)  # any leading shape; large |gate| saturates tanh
    _close(OPS.silu_mul(gate_up), PORTABLE_OPS.silu_mul(gate_up))
    _close(OPS.gelu_tanh_mul(gate_up), PORTABLE_OPS.gelu_tanh_mul(gate_up))


def test_rows_do_not_depend_on_their_batch_and_empty_inputs_work():
    x = _randn(9, 64, dtype=torch.bfloat16)
    w = _randn(64, dtype=torch.bfloat16, seed=1)
    assert torch.equal(OPS.rms_norm(x, w, 1e-5)[4], OPS.rms_norm(x[4:5], w, 1e-5)[0])
    assert torch.equal(OPS.silu_mul(x)[4], OPS.silu_mul(x[4:5])[0])
    empty = x[:0]
    assert OPS.rms_norm(empty, w, 1e-5).shape == (0, 64) and OPS.silu_mul(empty).shape == (0, 32)
    assert OPS.add_rms_norm(empty, empty, w, 1e-5)[1].shape == (0, 64)


class TritonOpsBackend(TorchBackend):
    """The portable backend with the Triton elementwise ops (the interpreter runs them on the CPU)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.ops = OPS


@pytest.mark.slow
def test_tiny_model_greedy_is_unchanged(tiny_model_factory, monkeypatch):
    path = str(tiny_model_factory("llama"))
    prompts = ["ab"]  # short: the interpreter takes ~1 ms per op of each program

    def run() -> list[list[int]]:
        config = EngineConfig(
            model=path,
            dtype="float32",
            backend="torch",
            device=DEVICE.type,
            max_num_seqs=2,
            max_model_len=64,
            threads=1,
        )
        return greedy_tokens(LLMEngine(config), prompts, 2)

    reference = run()
    monkeypatch.setitem(registry._BACKENDS, "torch", TritonOpsBackend)
    assert run() == reference
