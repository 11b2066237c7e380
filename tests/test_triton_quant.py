"""The Triton quantized matmuls (kernels/triton/quant_matmul.py) on the CPU through Triton's
interpreter: GEMMs against dequantize-then-matmul in fp32, the int4 layout's converters exact for
every source (RTN int4, AWQ, GPTQ incl. act-order, GGUF Q4_0 / Q4_1), row independence, bad input,
tiny models end to end on a test-only backend that offers the kernels; and fp8 weights (quantization/
fp8.py), whose torch._scaled_mm runs on the CPU too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from helpers.gguf_files import add_byte_level_tokenizer, add_layer_tensors, add_llama_shape, finish, random_blocks
from helpers.prequantized_files import (
    LINEARS,
    Scheme,
    _copy_side_files,
    awq_tensors,
    gptq_tensors,
    rtn,
    write_prequantized,
)
from safetensors.torch import load_file, save_file

from tachyllm.backends import registry
from tachyllm.backends.torch_backend import TorchBackend
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.errors import ConfigError
from tachyllm.eval.greedy import greedy_tokens
from tachyllm.kernels.triton import quant_matmul as qm
from tachyllm.loading.hf_quantized import QuantFormat, _read_awq, _read_gptq
from tachyllm.quantization.awq import awq_linear
from tachyllm.quantization.fp8 import Fp8Linear, quantize_fp8, quantize_rows
from tachyllm.quantization.gguf_packed import decode_q4_0, decode_q4_1
from tachyllm.quantization.int4 import Int4Linear, quantize_int4
from tachyllm.quantization.int8 import Int8Linear, quantize_int8
from tachyllm.quantization.prequantized import PermutedInput, build

T = GGMLQuantizationType
# Compiled on a GPU where there is one, else in the interpreter on the CPU (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = ["The quick brown fox", "def add(a, b):"]
# (N, K, group): ragged N (not a multiple of the 64-wide tile), one and several groups per row.
SHAPES = [(64, 64, 32), (100, 128, 64), (40, 256, 128)]
# Tolerance against the fp32 reference, relative to the output's scale: fp32 is exact up to the
# summation order; fp16 / bf16 round the activations and (on the GPU) the weight tile.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype
    err = (y.float().cpu() - ref.cpu()).abs().max().item()
    assert err <= RTOL[dtype] * ref.abs().max().item(), f"{dtype}: max error {err}"


# -- the GEMMs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_int4_gemm_matches_dequantize_then_matmul(shape, dtype):
    n, k, g = shape
    gen = torch.Generator().manual_seed(n + k)
    w = quantize_int4(torch.randn(n, k, generator=gen), g)
    packed = [t.to(DEVICE) for t in qm.pack_int4(w.codes, w.scales, w.mins, g)]
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
        ref = x.float() @ w.dequantize().to(DEVICE).t() + bias.float()
        _close(qm.int4_matmul(x, *packed, g, bias), ref, dtype)
    _close(qm.int4_matmul(x, *packed, g), ref - bias.float(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(64, 64), (100, 96)])
def test_int8_gemm_matches_dequantize_then_matmul(n, k, dtype):
    gen = torch.Generator().manual_seed(n)
    codes, scales = (t.to(DEVICE) for t in quantize_int8(torch.randn(n, k, generator=gen)))
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    for m in (1, 3, 17):
        x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
        ref = x.float() @ (codes.float() * scales[:, None]).t() + bias.float()
        _close(qm.int8_matmul(x, qm.pack_int8(codes), scales, bias), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(dtype):
    """The tile shape does not follow M: a row alone and among 20 others gives the same bits."""
    gen = torch.Generator().manual_seed(3)
    w = quantize_int4(torch.randn(100, 128, generator=gen), 64)
    packed = [t.to(DEVICE) for t in qm.pack_int4(w.codes, w.scales, w.mins, 64)]
    codes, scales = (t.to(DEVICE) for t in quantize_int8(torch.randn(100, 128, generator=gen)))
    x = torch.randn(21, 128, generator=gen).to(DEVICE, dtype)
    batch4, batch8 = qm.int4_matmul(x, *packed, 64), qm.int8_matmul(x, qm.pack_int8(codes), scales)
    for row in (0, 17):
        assert torch.equal(qm.int4_matmul(x[row : row + 1], *packed, 64)[0], batch4[row])
        assert torch.equal(qm.int8_matmul(x[row : row + 1], qm.pack_int8(codes), scales)[0], batch8[row])


def test_bad_inputs_are_refused():
    w = quantize_int4(torch.randn(64, 64), 32)
    packed = qm.pack_int4(w.codes, w.scales, w.mins, 32)
    with pytest.raises(ValueError, match=r"expected \[rows, 64\]"):
        qm.int4_matmul(torch.randn(2, 32), *packed, 32)
    with pytest.raises(ValueError, match="activations must be fp32, fp16 or bf16"):
        qm.int4_matmul(torch.ones(2, 64, dtype=torch.int32), *packed, 32)
    with pytest.raises(ValueError, match="group size 16 must be a multiple of 32"):
        qm.pack_int4(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 4), torch.zeros(8, 4), 16)


# -- the int4 converters: bit-identical to each source's own dequantization --------------------------
def _layout_weight(module: torch.nn.Module) -> torch.Tensor:
    return qm.dequantize_int4(module.packed, module.scales, module.mins, module.group_size)


def test_rtn_int4_converts_exactly():
    w = quantize_int4(torch.randn(48, 128), 32)
    module = Int4Linear(w, None, matmul=qm)
    assert module.kernel == "triton" and module.scales.dtype == torch.float32  # RTN scales are not fp16 values
    assert torch.equal(_layout_weight(module), w.dequantize())


@pytest.mark.parametrize(
    "method,sym,act_order", [("awq", False, False), ("gptq", True, False), ("gptq", False, False), ("gptq", True, True)]
)
def test_checkpoint_int4_converts_exactly(method, sym, act_order):
    """AWQ (GEMM packing, zero points) and GPTQ (sym / asym, desc_act permuted once at load) through the
    checkpoint reader and prequantized.build, against PackedLinear.dequantize (the reference formula)."""
    gen = torch.Generator().manual_seed(1)
    out, k, group = 64, 128, 32
    g_idx = torch.randperm(k, generator=gen) // group if act_order else None
    qz = rtn(torch.randn(out, k, generator=gen) * 0.1, 4, group, sym, g_idx)
    if method == "awq":
        tensors, fmt, reader = awq_tensors(qz), QuantFormat("awq", "gemm", 4), _read_awq
    else:
        tensors, fmt, reader = gptq_tensors(qz, 4, v1=True), QuantFormat("gptq", "gptq", 4), _read_gptq
    packed = reader(tensors.get, fmt)
    built = build([packed], None, None, torch.device("cpu"), qm)
    module = built.module.inner if act_order else built.module
    assert isinstance(built.module, PermutedInput) == act_order and module.kernel == "triton"
    reference = packed.dequantize()
    if act_order:
        reference = reference[:, built.module.perm]
    assert torch.equal(_layout_weight(module), reference)
    # The file's fp16 scales stay fp16; mins -s * z fit fp16 only for symmetric z = 8.
    assert module.scales.dtype == torch.float16 and module.mins.dtype == (torch.float16 if sym else torch.float32)
    x = torch.randn(3, k, generator=gen)
    _close(built.module.to(DEVICE)(x.to(DEVICE)), x @ packed.dequantize().t(), torch.float32)


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1])
def test_gguf_blocks_convert_exactly(kind):
    raw = random_blocks(kind, 40, 96, np.random.default_rng(2))
    reference = torch.from_numpy(dequantize(raw, kind).reshape(40, 96))
    decode = decode_q4_0 if kind == T.Q4_0 else decode_q4_1  # what int4_weight reads a file's matrix with
    module = Int4Linear(decode(raw, 40), None, matmul=qm)
    assert module.scales.dtype == torch.float16  # the file's fp16 d (and m, or -8d): kept in half the bytes
    assert torch.equal(_layout_weight(module), reference)


def test_awq_input_scale_reaches_the_kernel():
    """tachyllm's own AWQ: the per-input-channel scale multiplies x before the Triton GEMM."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(128, 48, device=DEVICE)
    x = torch.randn(256, 128, generator=gen).to(DEVICE)
    x[:, [3, 77]] *= 40  # salient channels: the search picks a scale
    module, _, _ = awq_linear(linear, x, 64, None, qm)
    assert module.kernel == "triton" and module.input_scale is not None
    rows = x[:5]
    expected = (rows * module.input_scale.float()) @ _layout_weight(module).t() + linear.bias.detach()
    _close(module(rows), expected, torch.float32)


def test_int8_linear_runs_the_kernel_on_its_weights():
    linear = torch.nn.Linear(96, 40, device=DEVICE)
    ref_module, module = Int8Linear.from_linear(linear), Int8Linear.from_linear(linear, qm)
    assert torch.equal(module.dequantized(), ref_module.dequantized())
    x = torch.randn(5, 96, device=DEVICE)
    expected = x @ module.dequantized().t() + linear.bias.detach()
    _close(module(x), expected, torch.float32)


# -- end to end: a test-only backend that offers the kernels ---------------------------------------
class TritonMatmulBackend(TorchBackend):
    """The portable backend plus the Triton quantized matmuls (the interpreter runs them on the CPU)."""

    def quantized_matmul_kernels(self):
        return qm


@pytest.fixture
def triton_matmul_backend(monkeypatch):
    """`backend="torch"` builds the test-only backend for the duration of a test."""
    monkeypatch.setitem(registry._BACKENDS, "torch", TritonMatmulBackend)


def _engine(path: Path | str, **kwargs) -> LLMEngine:
    config = {"model": str(path), "dtype": "float32", "device": DEVICE.type, "max_num_seqs": 2, "max_model_len": 64}
    return LLMEngine(EngineConfig(**{**config, "threads": 1, **kwargs}))


def _triton_layers(engine: LLMEngine) -> list[Int4Linear]:
    layers = [m for m in engine.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * 2 and all(m.kernel == "triton" for m in layers)  # qkv, o, gate_up, down x 2
    return layers


@pytest.fixture
def tiny_base(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.mark.slow
def test_int4_model_greedy_equals_its_fp32_dequantization(tiny_base, tmp_path, triton_matmul_backend):
    quantized = _engine(tiny_base, backend="torch", quantization="int4", quant_group_size=32)
    _triton_layers(quantized)
    # The reference checkpoint: every decoder linear replaced by its RTN int4 dequantization in fp32.
    state = load_file(tiny_base / "model.safetensors")
    for name, tensor in state.items():
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS and name.endswith(".weight"):
            state[name] = quantize_int4(tensor.float(), 32).dequantize()
    (tmp_path / "ref").mkdir()
    save_file(state, tmp_path / "ref" / "model.safetensors")
    _copy_side_files(tiny_base, tmp_path / "ref", json.loads((tiny_base / "config.json").read_text()))
    assert greedy_tokens(quantized, PROMPTS, 4) == greedy_tokens(_engine(tmp_path / "ref"), PROMPTS, 4)


@pytest.mark.slow
def test_awq_checkpoint_greedy_equals_its_fp32_dequantization(tiny_base, tmp_path, triton_matmul_backend):
    write_prequantized(tiny_base, tmp_path / "q", tmp_path / "ref", Scheme("awq", group=32))
    quantized = _engine(tmp_path / "q", backend="torch")
    _triton_layers(quantized)
    assert greedy_tokens(quantized, PROMPTS, 4) == greedy_tokens(_engine(tmp_path / "ref"), PROMPTS, 4)


def _q4_0_gguf(path: Path) -> Path:
    """A 2-layer llama GGUF, 64 wide, every decoder matrix Q4_0 (F32 embedding, head and norms)."""
    rng = np.random.default_rng(4)
    hidden, ffn, heads, kv_heads = 64, 128, 4, 2
    writer = GGUFWriter(path, "llama")
    add_llama_shape(writer, layers=2, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads, context=64)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = add_byte_level_tokenizer(writer)
    writer.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.5).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output.weight", (rng.standard_normal((vocab, hidden)) * 0.2).astype(np.float32))

    def add(name: str, *shape: int, quantize: bool = True) -> None:
        if quantize:
            writer.add_tensor(name, random_blocks(T.Q4_0, *shape, rng, amplitude=0.3), raw_dtype=T.Q4_0)
        else:
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))

    for i in range(2):
        add_layer_tensors(add, i, hidden, heads, kv_heads, hidden // heads, ffn)
    finish(writer)
    return path


@pytest.mark.slow
def test_gguf_q4_0_greedy_equals_the_file_dequantized(tmp_path, triton_matmul_backend):
    path = _q4_0_gguf(tmp_path / "q4_0.gguf")
    quantized = _engine(path, backend="torch", quantization="gguf")
    _triton_layers(quantized)
    assert greedy_tokens(quantized, PROMPTS, 4) == greedy_tokens(_engine(path, backend="torch"), PROMPTS, 4)


# -- fp8 -------------------------------------------------------------------------------------------
def test_fp8_weights_round_within_e4m3_precision():
    w = torch.randn(48, 64)
    codes, scales = quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (48,)
    # e4m3 keeps 3 mantissa bits: a relative rounding of at most 2^-4, plus subnormals near zero.
    err = (codes.float() * scales[:, None] - w).abs()
    assert (err <= w.abs() * 2**-4 + scales[:, None] * 2**-9).all()


def test_fp8_linear_matches_its_scaled_reference():
    gen = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(64, 48)
    module = Fp8Linear.from_linear(linear)
    x = torch.randn(7, 64, generator=gen) * 3
    xq, x_scales = quantize_rows(x)
    expected = (xq.float() * x_scales) @ module.dequantized().t() + linear.bias.detach()
    y = module(x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert (y - linear(x)).abs().max() < 0.1 * linear(x).abs().max()  # and near the unquantized layer
    # Row by row the same up to rounding (not bit for bit: the CPU's _scaled_mm blocks by row count).
    torch.testing.assert_close(module(x[2:3])[0], y[2], rtol=1e-5, atol=1e-5)


def test_fp8_model_runs_on_the_cpu(tiny_model_factory):
    engine = _engine(tiny_model_factory("llama"), quantization="fp8", device="cpu")
    layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 2
    assert all(len(t) == 4 for t in greedy_tokens(engine, PROMPTS, 4))


def test_fp8_is_refused_where_it_cannot_run():
    from tachyllm.quantization import quantize_model

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(ConfigError, match="quantization='fp8' cannot run here: fp8 weights run on CUDA"):
        quantize_model(model, "fp8", None, ())
    with pytest.raises(ConfigError, match="quant_activation_bits applies to quantization int4"):
        EngineConfig(model="x", quantization="fp8", quant_activation_bits=8)
