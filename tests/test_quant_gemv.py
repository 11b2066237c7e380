"""The C++ block kernels (kernels/csrc/quant_gemv.cpp): Q4_1 and Q8_0 tiles against fp32 references,
Int4Linear's kernel against aten's, the GGUF LM head policy on a tiny file, and the default model
under quantization="gguf" with and without the kernels."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers.gguf_files import write_tiny_q4_1_gguf
from helpers.quantization import EXACT_RTOL, UNROUNDED_RTOL, round_activations
from torch import nn

from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.eval.greedy import agreement, greedy_tokens
from tachyllm.eval.quality import sequence_logprobs
from tachyllm.kernels import native
from tachyllm.quantization.gguf_packed import GGUFLinear
from tachyllm.quantization.int4 import Int4Linear, quantize_int4

ops = native.native_ops()
pytestmark = pytest.mark.native
# Int4Linear and the Q8_0 head only use the kernels when they were built with AVX-512 VNNI.
needs_simd = pytest.mark.skipif(
    ops is not None and ops.quant_gemv_isa() == "scalar",
    reason="C++ kernels built without AVX-512 VNNI (scalar fallback)",
)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _fp16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()  # the tiles store d and m in fp16, as GGUF does


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [16, 8])
def test_q4_1_kernel_matches_reference(rows, dtype, bits):
    torch.manual_seed(rows)
    out_f, in_f = 45, 96  # 3 tiles (the last one partial), 3 blocks per row
    w = quantize_int4(torch.randn(out_f, in_f), 32)
    w.scales, w.mins = _fp16_exact(w.scales), _fp16_exact(w.mins)
    packed = ops.quant_pack_q4_1(w.codes, w.scales, w.mins)
    x = torch.randn(rows, in_f).to(dtype)
    y = ops.quant_gemv_q4_1(x, packed, out_f, bits)
    assert y.dtype == dtype and y.shape == (rows, out_f)
    weight = w.dequantize().double()
    assert _rel_err(y, round_activations(x, bits) @ weight.t()) < EXACT_RTOL[dtype]
    assert _rel_err(y, x.double() @ weight.t()) < UNROUNDED_RTOL[bits] + EXACT_RTOL[dtype]


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [16, 8])
def test_q8_0_kernel_matches_reference(rows, dtype, bits):
    torch.manual_seed(rows)
    out_f, in_f = 37, 160
    codes = torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8)  # -128 is legal in a GGUF block
    scales = _fp16_exact(torch.rand(out_f, in_f // 32) * 0.01)
    packed = ops.quant_pack_q8_0(codes, scales)
    x = torch.randn(rows, in_f).to(dtype)
    y = ops.quant_gemv_q8_0(x, packed, out_f, bits)
    assert y.dtype == dtype and y.shape == (rows, out_f)
    weight = (codes.double().view(out_f, -1, 32) * scales.double()[..., None]).view(out_f, in_f)
    assert _rel_err(y, round_activations(x, bits) @ weight.t()) < EXACT_RTOL[dtype]
    assert _rel_err(y, x.double() @ weight.t()) < UNROUNDED_RTOL[bits] + EXACT_RTOL[dtype]


def test_kernels_split_over_threads_and_handle_edge_inputs():
    torch.manual_seed(0)
    w = quantize_int4(torch.randn(1000, 576), 32)
    packed = ops.quant_pack_q4_1(w.codes, w.scales, w.mins)
    x = torch.randn(5, 576)
    x[1] = 0  # all-zero blocks: scale 0, no division by zero
    x[2, :32] = 1e-30
    one = ops.quant_gemv_q4_1(x, packed, 1000)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = ops.quant_gemv_q4_1(x, packed, 1000)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # rows are independent of the split: same bits
    assert torch.isfinite(one).all()
    assert (one[1] == 0).all()  # zero input -> zero output
    # Each activation row's result does not depend on the other rows in the batch.
    assert torch.equal(ops.quant_gemv_q4_1(x[3:4], packed, 1000), one[3:4])
    assert torch.equal(ops.quant_gemv_q4_1(x.view(1, 5, 576), packed, 1000), one.view(1, 5, 1000))  # [..., in]
    assert torch.equal(ops.quant_gemv_q4_1(x.t().contiguous().t(), packed, 1000), one)  # strided input
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quant_gemv_q4_1(torch.randn(1, 48), packed, 1000)
    with pytest.raises(RuntimeError, match="do not match out_features"):
        ops.quant_gemv_q4_1(x, packed, 980)
    with pytest.raises(RuntimeError, match="activation_bits"):
        ops.quant_gemv_q4_1(x, packed, 1000, 4)


@needs_simd
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_int4_linear_native_matches_aten(group, tokens):
    torch.manual_seed(group + tokens)
    linear = nn.Linear(256, 80, bias=True)
    fast = Int4Linear.from_linear(linear, group, ops)
    slow = Int4Linear.from_linear(linear, group)
    assert (fast.kernel, slow.kernel) == ("blocks", "aten")
    x = torch.randn(2, tokens, 256, dtype=torch.bfloat16)
    y_fast, y_slow = fast(x), slow(x)
    assert y_fast.shape == y_slow.shape == (2, tokens, 80) and y_fast.dtype == torch.bfloat16
    # aten rounds activations, scales and zeros to bf16: ~1e-2 relative, like test_quantization.py.
    assert _rel_err(y_fast, y_slow) < 1e-2
    reference = (
        x.double() @ quantize_int4(linear.weight.detach(), group).dequantize().double().t()
        + linear.bias.detach().double()
    )
    assert _rel_err(y_fast, reference) < 5e-3  # native: 16-bit activations, fp16 (d, m): only the bf16 output
    assert fast.packed.numel() == 80 // 16 * 256 // 32 * 320  # 0.625 byte per weight whatever the group
    no_bias = Int4Linear(quantize_int4(linear.weight.detach(), group), None, kernels=ops)  # the one-call path
    torch.testing.assert_close(no_bias(x) + linear.bias.detach().to(torch.bfloat16), y_fast, rtol=1e-2, atol=1e-2)


# -- the GGUF LM head -----------------------------------------------------------------------------
def _engine(path: Path, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(path), quantization="gguf", max_num_seqs=2, max_model_len=64, threads=1, **kwargs)
    )


@needs_simd
def test_gguf_q8_0_head_whatever_quant_skip_says(tmp_path, monkeypatch, caplog):
    """A Q8_0 head runs on its blocks with the default skip, an explicit lm_head skip and 'none'
    alike (its dequantized copy would only be rounded once more); without the kernels it is
    dequantized, and the log line says which."""
    path = write_tiny_q4_1_gguf(tmp_path / "q8-head.gguf", GGMLQuantizationType.Q8_0)
    ids = list(range(3, 40))
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        # 16-bit activations, as the bound on the KL against the dequantized head was measured.
        engines = {skip: _engine(path, quant_skip=skip, quant_activation_bits=16) for skip in (None, "lm_head", "none")}
    assert "lm_head: the file's Q8_0 blocks (model.embed_tokens.weight), C++ kernel" in caplog.text
    assert "embed_tokens: the file's Q8_0 blocks, the tied LM head's tiles (one copy)" in caplog.text
    assert "left unquantized (skipped by quant_skip): lm_head" not in caplog.text
    for engine in engines.values():
        assert isinstance(engine.model.lm_head, GGUFLinear) and engine.model.lm_head.block_types == "Q8_0"
        assert isinstance(engine.model.layers[0].mlp.down_proj, GGUFLinear)
    caplog.clear()
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="tachyllm"):
        m.setattr(native, "native_ops", lambda: None)
        plain = _engine(path)
        assert not isinstance(plain.model.lm_head, GGUFLinear)
        lp_plain = sequence_logprobs(plain, ids)
    assert "lm_head: model.embed_tokens.weight (Q8_0 in the file) dequantized to torch.bfloat16" in caplog.text
    lp = sequence_logprobs(engines[None], ids)
    assert (lp.argmax(-1) == lp_plain.argmax(-1)).float().mean() >= 0.9
    assert (lp.exp() * (lp - lp_plain)).sum(-1).max() < 0.01  # measured 5e-4


@needs_simd
def test_gguf_q4_head(tmp_path, monkeypatch):
    """With the kernels a Q4_1 head runs on its blocks like any other; without them it follows
    quant_skip (skipped by default: dequantized)."""
    path = write_tiny_q4_1_gguf(tmp_path / "q4-head.gguf", GGMLQuantizationType.Q4_1)
    for skip in (None, "none"):
        head = _engine(path, quant_skip=skip).model.lm_head
        assert isinstance(head, GGUFLinear) and head.block_types == "Q4_1"  # the tied token_embd's own blocks
    monkeypatch.setattr(native, "native_ops", lambda: None)
    assert not isinstance(_engine(path).model.lm_head, Int4Linear | GGUFLinear)


# -- the default model -----------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


@needs_simd
@pytest.mark.slow
def test_default_model_gguf_with_and_without_kernels(monkeypatch):
    """Q4_1 layers and the Q8_0 head on the C++ kernels vs aten int4 and the dequantized bf16 head.
    Measured against the fp32 engine on 6 held-out windows of 128 tokens: mean KL 0.0012 (kernels,
    16-bit activations) vs 0.0015 (aten, bf16 activations); 8-bit activations measured 0.0044."""
    options = dict(quantization="gguf", quant_activation_bits=16, max_num_seqs=4, max_model_len=256, threads=2)
    engine = LLMEngine(EngineConfig(**options))
    assert isinstance(engine.model.lm_head, GGUFLinear)
    assert isinstance(engine.model.layers[0].self_attn.qkv_proj, GGUFLinear)
    # 66 MB of Q4_1 layers + 30 MB of Q8_0 head (the bf16 table is only gathered from).
    assert 90e6 < engine.weight_bytes < 100e6
    ids = [1, 504, 3458, 282, 4649, 314, 7042, 30, 198, 504, 1678, 282] * 4
    lp = sequence_logprobs(engine, ids)
    text = greedy_tokens(engine, PROMPTS, 24)
    assert "Paris" in engine.tokenizer.decode(text[0])
    with monkeypatch.context() as m:
        m.setattr(native, "native_ops", lambda: None)
        plain = LLMEngine(EngineConfig(**options))
        assert plain.model.layers[0].self_attn.qkv_proj.kernel == "aten"
        lp_plain = sequence_logprobs(plain, ids)
        text_plain = greedy_tokens(plain, PROMPTS, 24)
    # Measured: all 48 argmaxes equal, max KL 0.013, greedy text 93% position-wise equal (one of the
    # four prompts drifts late; the same as against the bf16 engine, test_quantization.py's reference).
    assert (lp.argmax(-1) == lp_plain.argmax(-1)).float().mean() >= 0.95
    assert (lp.exp() * (lp - lp_plain)).sum(-1).max() < 0.03
    assert agreement(text, text_plain) >= 0.85
    assert engine.backend.block_kernels() is not None
