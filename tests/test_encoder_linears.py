"""An encoder's linears (BERT, the pooling runner): in bf16 they run on oneDNN's prepacked GEMM where
oneDNN packs bf16 (an encoder step is hundreds of rows, where the decode matrix-vector kernel is slow),
with the MLP's GELU and the residual adds inside the GEMMs, and an input's embedding stays the same
alone and packed with inputs of other lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.pooling_models import make_tiny_bert

from tachyllm.entrypoints.llm import LLM
from tachyllm.kernels.linear import PackedLinear, fuse_gelu, linear_add, onednn_packing_available

TEXTS = ["a", "the quick brown fox jumps over the lazy dog", "hello world, again and again and again", "x y"]


@pytest.mark.skipif(not onednn_packing_available(torch.bfloat16), reason="oneDNN packs no bf16 on this CPU")
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bf16_encoder_linears_are_onednn_packed_and_packing_invariant(tmp_path, backend):
    llm = LLM(str(make_tiny_bert(tmp_path)), dtype="bfloat16", backend=backend)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * 2  # qkv, o, up, down in each of the tiny model's 2 layers
    assert all(m.packed_weight is not None and m.ops is None for m in linears)
    alone = [torch.tensor(llm.embed(text)[0].outputs.embedding) for text in TEXTS]
    packed = llm.embed(TEXTS + TEXTS[::-1])
    for i, vector in enumerate(alone):
        assert torch.equal(torch.tensor(packed[i].outputs.embedding), vector)
        assert torch.equal(torch.tensor(packed[-1 - i].outputs.embedding), vector)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_encoder_mlps_fuse_gelu_and_residual_adds_into_their_gemms(tmp_path, dtype):
    if not onednn_packing_available(dtype):
        pytest.skip(f"oneDNN packs no {dtype} on this CPU")
    llm = LLM(str(make_tiny_bert(tmp_path)), dtype=str(dtype).removeprefix("torch."))
    for layer in llm.engine.runner.model.layers:
        assert layer.up_proj.post_op == "gelu" and isinstance(layer.activation, torch.nn.Identity)
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48).to(dtype)
    plain, gelu = PackedLinear(linear), PackedLinear(linear)
    assert fuse_gelu(gelu) and not fuse_gelu(torch.nn.Linear(4, 4))
    for rows in (1, 5):  # one row is computed as two, like every other
        x, residual = torch.randn(rows, 32, dtype=dtype), torch.randn(rows, 48, dtype=dtype)
        expected = linear(x)
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(plain(x), expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(gelu(x), F.gelu(expected), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(linear_add(plain, x, residual), expected + residual, rtol=tolerance, atol=tolerance)
        assert torch.equal(linear_add(plain, x[:1], residual[:1]), linear_add(plain, x, residual)[:1])
        assert torch.equal(gelu(x[:1]), gelu(x)[:1])
