"""Weight-only quantization: packing round trips, kernels vs dequantized references, AWQ search,
GGUF-native int4, layer policy and bad options, and end-to-end greedy agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from helpers.quantization import BLOCK_KERNELS, engine_for, teacher_forced_top1
from torch import nn

from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.errors import ConfigError
from tachyllm.eval.greedy import agreement
from tachyllm.eval.greedy import greedy_tokens as greedy
from tachyllm.eval.quality import compare, eval_engine, heldout_windows, sequence_logprobs
from tachyllm.loading.gguf import open_gguf, raw_tensors
from tachyllm.quantization.activation_bits import model_activation_bits
from tachyllm.quantization.awq import awq_linear, output_error, search_scale
from tachyllm.quantization.gguf_packed import decode_q4_0, decode_q4_1
from tachyllm.quantization.int4 import (
    Int4Linear,
    Int4Weight,
    pack_nibbles,
    quantize_int4,
    unpack_nibbles,
)
from tachyllm.quantization.int8 import Int8Linear, dequantize_int8, quantize_int8
from tachyllm.quantization.policy import parse_skip, select_linears

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paged attention stores keys", "0123456789 numbers"]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_nibble_pack_round_trip():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_error_is_at_most_half_a_step(group):
    w = torch.randn(48, 256)
    q = quantize_int4(w, group)
    assert q.codes.max() <= 15 and q.scales.shape == (48, 256 // group)
    err = (q.dequantize() - w).abs().view(48, -1, group)
    assert (err <= q.scales[..., None] / 2 + 1e-6).all()


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = torch.randn(40, 96)
    codes, scales = quantize_int8(w)
    assert ((dequantize_int8(codes, scales) - w).abs() <= scales[:, None] / 2 + 1e-6).all()


# Tolerance: the kernels take bf16 activations and bf16 scales and return bf16 (8-bit mantissa,
# relative rounding 2^-9 per value); accumulated over a dot product that stays well under 1%.
KERNEL_RTOL = 1e-2


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_int4_linear_matches_dequantized_reference(group, tokens):
    linear = nn.Linear(256, 96, bias=True)
    q = Int4Linear.from_linear(linear, group)
    ref_w = quantize_int4(linear.weight.detach(), group).dequantize()
    x = torch.randn(tokens, 256)
    ref = x @ ref_w.t() + linear.bias.detach()
    assert _rel_err(q(x), ref) < KERNEL_RTOL
    assert q(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("tokens", [1, 70])
def test_int8_linear_matches_dequantized_reference(tokens):
    linear = nn.Linear(192, 80, bias=False)
    q = Int8Linear.from_linear(linear)
    x = torch.randn(3, tokens, 192)
    assert _rel_err(q(x), x @ q.dequantized().t()) < KERNEL_RTOL
    assert q(x).shape == (3, tokens, 80)


def test_awq_scale_search_beats_round_to_nearest_on_outlier_channels():
    torch.manual_seed(0)
    weight = torch.randn(128, 256) * 0.05
    x = torch.randn(512, 256)
    salient = torch.tensor([3, 77, 150, 201])
    x[:, salient] *= 40  # a few channels carry most of the activation energy, as in real LLMs
    scale, plain, best = search_scale(weight, x, 128)
    assert scale is not None and best < 0.7 * plain
    assert output_error(weight, x, 128, scale) == pytest.approx(best)
    # The module built from the search reproduces that gain (up to the kernel's bf16 rounding).
    linear = nn.Linear(256, 128, bias=False)
    linear.weight.data.copy_(weight)
    layer, _, _ = awq_linear(linear, x, 128)
    ref = x @ weight.t()
    plain_layer = Int4Linear.from_linear(linear, 128)
    assert (layer(x) - ref).pow(2).mean() < 0.8 * (plain_layer(x) - ref).pow(2).mean()


def test_awq_keeps_round_to_nearest_when_nothing_is_salient():
    torch.manual_seed(1)
    weight, x = torch.randn(32, 128), torch.randn(64, 128)
    _, plain, best = search_scale(weight, x, 64)
    assert best <= plain


def _blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid GGUF blocks: finite fp16 scales, any nibbles."""
    rng = np.random.default_rng(seed)
    nblocks = cols // 32
    size = 20 if kind == GGMLQuantizationType.Q4_1 else 18
    raw = rng.integers(0, 256, (rows, nblocks, size), dtype=np.uint8)
    scales = rng.uniform(-0.1, 0.1, (rows, nblocks, (size - 16) // 2)).astype(np.float16)
    raw[..., : size - 16] = scales.view(np.uint8).reshape(rows, nblocks, size - 16)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0])
def test_gguf_block_decoding_matches_the_gguf_package(kind):
    raw = _blocks(kind, 6, 128)
    decode = decode_q4_1 if kind == GGMLQuantizationType.Q4_1 else decode_q4_0
    ours = decode(raw, 6).dequantize()
    theirs = torch.from_numpy(dequantize(raw, kind).reshape(6, 128))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_default_model_q4_1_tensor_decodes_exactly(default_model_path):
    name, tensor = next(
        (n, t) for n, t in raw_tensors(open_gguf(default_model_path)) if n.endswith("mlp.down_proj.weight")
    )
    rows = int(tensor.shape[1])
    ours = decode_q4_1(np.asarray(tensor.data), rows).dequantize()
    theirs = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type)).reshape(rows, -1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_int4_concat_stacks_rows():
    a, b = quantize_int4(torch.randn(4, 64), 32), quantize_int4(torch.randn(6, 64), 32)
    both = Int4Weight.concat([a, b])
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


# -- policy and bad input ------------------------------------------------------------------------
class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = nn.Linear(8, 24)
        self.mlp = nn.Module()
        self.mlp.down_proj = nn.Linear(16, 8)
        self.lm_head = nn.Linear(8, 10)


def test_quant_skip_policy():
    toy = _Toy()
    assert (
        parse_skip(None) == ("lm_head",)
        and parse_skip("none") == ()
        and parse_skip("lm_head, attn") == ("lm_head", "attn")
    )
    assert select_linears(toy, ("lm_head",)) == (["self_attn.qkv_proj", "mlp.down_proj"], ["lm_head"])
    assert select_linears(toy, ("lm_head", "attn"))[0] == ["mlp.down_proj"]
    assert select_linears(toy, ())[1] == []
    with pytest.raises(ConfigError, match="quant_skip.*attention.*accepted: lm_head, attn, mlp"):
        select_linears(toy, ("attention",))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"quantization": "int3"}, "quantization must be one of int8, int4, awq, gguf"),
        ({"quantization": "int4", "quant_group_size": 48}, "quant_group_size must be one of 32, 64, 128"),
        ({"quantization": "int8", "quant_group_size": 64}, "quant_group_size applies to quantization int4 or awq"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8"),
        ({"quantization": "gguf", "quant_activation_bits": 4}, "quant_activation_bits must be 8 or 16, got 4"),
        ({"quantization": "int8", "quant_activation_bits": 8}, "quant_activation_bits applies to .* not 'int8'"),
    ],
)
def test_bad_options_raise_one_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_group_size_that_does_not_divide_a_layer(tiny_model_factory):
    # hidden_size 96: 96 % 64 == 0 but 96 % 128 != 0 ... use 80 so 64 does not divide the 80-wide inputs.
    path = tiny_model_factory(
        "llama", hidden_size=80, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    with pytest.raises(
        ConfigError,
        match=r"quant_group_size=64 does not divide layer layers\.0\.self_attn\.qkv_proj \(in_features=80\)",
    ):
        LLMEngine(
            EngineConfig(model=str(path), quantization="int4", quant_group_size=64, max_num_seqs=2, max_model_len=64)
        )


def test_gguf_quantization_needs_a_gguf_model(tiny_model_factory):
    with pytest.raises(ConfigError, match="quantization='gguf' needs a GGUF model file"):
        LLMEngine(
            EngineConfig(model=str(tiny_model_factory("llama")), quantization="gguf", max_num_seqs=2, max_model_len=64)
        )


# -- end to end ----------------------------------------------------------------------------------


# Tiny random models are judged teacher-forced, not by greedy text: their logits are full of
# near-ties (bf16 alone keeps only ~67% of fp32's greedy tokens), so one flip changes the rest of a
# continuation. int8 keeps ~92% top-1 there, int4 (64-wide layers quantized in one or two groups of
# unstructured Gaussian weights) ~40%, far above chance (1/400) and the ~0% a broken layout gives.
# The real model below carries the meaningful thresholds.
TINY_TOP1 = {"int8": 0.85, "int4": 0.3, "awq": 0.3}


@pytest.mark.parametrize("method", ["int8", "int4", "awq"])
def test_tiny_model_quantized_runs_and_agrees(tiny_model_factory, method):
    path = str(tiny_model_factory("llama"))
    assert teacher_forced_top1(path, quantization=method) >= TINY_TOP1[method]
    assert all(len(t) == 8 for t in greedy(engine_for(path, quantization=method), PROMPTS, 8))


@pytest.mark.native
@pytest.mark.skipif(BLOCK_KERNELS is None, reason="needs the C++ block kernels (AVX-512 VNNI)")
def test_activation_bits_reach_the_kernels_and_keep_rows_independent(tiny_model_factory):
    """quant_activation_bits=8 rounds every block-kernel layer's input to int8 (llama.cpp's Q8_1):
    the logprobs move away from the 16-bit ones, stay close to them, and in bf16 (where every kernel
    of a step is row-independent) a prompt's logprobs are the same alone and in a batch: every row
    is rounded on its own."""
    from tachyllm import LLM, SamplingParams

    path = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = ["hello hello hello hello", "def add(a, b): return a + b " * 3, "x"]

    def run(bits: int, batch: list[str]):
        llm = LLM(
            model=path,
            dtype="bfloat16",
            quantization="int4",
            quant_group_size=32,
            quant_activation_bits=bits,
            kv_cache_memory=1 << 22,
        )
        layers = [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]
        assert layers and all(m.activation_bits == bits for m in layers)
        return [[sorted(d.items()) for d in o.outputs[0].logprobs] for o in llm.generate(batch, params, use_tqdm=False)]

    coarse, fine = run(8, prompts), run(16, prompts)
    assert coarse != fine
    first_token = [[lp.logprob for _, lp in run_[0][0]] for run_ in (coarse, fine)]  # its top logprobs
    assert np.allclose(first_token[0], first_token[1], atol=0.1)
    assert run(8, prompts[:1]) == coarse[:1]


def test_tiny_qwen2_with_bias_quantizes(tiny_model_factory):
    path = str(tiny_model_factory("qwen2"))
    assert teacher_forced_top1(path, quantization="int8") >= TINY_TOP1["int8"]


# Default model. Plain int4 here re-rounds weights that already went through Q4_1 (group 32) onto
# groups of 64/128, so greedy text drifts early (~15% position-wise agreement measured with fp32,
# AWQ ~40%); those are judged teacher-forced against the bf16 engine (measured: int8 ~96%, int4
# ~70%, awq ~79%, gguf ~97% against fp32; against the bf16 engine gguf 96.6% at 8-bit
# activations, which the load-time check picks for this model, 97.9% at 16). Greedy text is required
# to match for int8 and gguf, which measured ~89% and ~99% (gguf against the bf16 engine: 91% at 8 bits, 89% at
# 16). int8's bar leaves room for one early flip: at "Water boils at" + 2
# tokens its top two logits tie (log-probs -1.749 and -1.749), so which one greedy picks follows the
# last bits of the attention kernel (74% with the bf16-pair kernel, 88% with the fp32 one).
REAL_TOP1 = {"int8": 0.9, "int4": 0.6, "awq": 0.7, "gguf": 0.93}
REAL_GREEDY = {"int8": 0.7, "gguf": 0.85}
REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4", "awq", "gguf"])
def test_default_model_quantized_agrees(method):
    ref = eval_engine(EngineConfig(threads=2), 128)
    engine = eval_engine(EngineConfig(threads=2, quantization=method), 128)
    report = compare(engine, ref, heldout_windows(ref, 128, 6), (method, "bf16"))
    assert report.top1_agreement >= REAL_TOP1[method]
    out = greedy(engine_for(None, quantization=method), REAL_PROMPTS, 24)
    assert all(len(t) == 24 for t in out)
    if method in REAL_GREEDY:
        assert agreement(out, greedy(engine_for(None), REAL_PROMPTS, 24)) >= REAL_GREEDY[method]


@pytest.mark.slow
@pytest.mark.native
@pytest.mark.skipif(
    BLOCK_KERNELS is None, reason="8-bit activations are a mode of the C++ block kernels (AVX-512 VNNI)"
)
def test_default_model_8bit_activations_cost_little_top1():
    """The default model's Q4_1 blocks pass the load-time check (measured KL(16 || 8) 0.005 against the
    0.01 bound), so gguf unset runs 8-bit activations: against the bf16 engine, beside 16 bits
    (quant_activation_bits=16) on the same windows, measurably further from it (mean KL against fp32
    measured 0.0044 vs 0.0012 with `tachy eval quality`), still agreeing on the top token almost always."""
    ref = eval_engine(EngineConfig(threads=2), 128)
    windows = heldout_windows(ref, 128, 6)
    engines = [eval_engine(EngineConfig(threads=2, quantization="gguf", quant_activation_bits=16), 128)]
    engines.append(eval_engine(EngineConfig(threads=2, quantization="gguf"), 128))
    assert [model_activation_bits(e.model) for e in engines] == [16, 8]
    fine, coarse = (compare(e, ref, windows, ("gguf", "bf16")) for e in engines)
    assert coarse.top1_agreement >= REAL_TOP1["gguf"] - 0.03
    assert fine.kl_mean < coarse.kl_mean < 10 * fine.kl_mean


@pytest.mark.slow
def test_gguf_native_matches_dequantize_then_int4(default_model_path):
    """Q4_1 blocks loaded packed vs the same weights dequantized and re-rounded to int4 group 32:
    re-rounding a Q4_1 block recovers its codes (RTN hits the block's own min and max), so the
    two models differ only by float rounding of the scales (both at 16-bit activations)."""
    ids = [1, 504, 3458, 282, 4649, 314, 7042, 30, 198, 504, 1678, 282] * 4
    native = sequence_logprobs(engine_for(None, quantization="gguf", quant_activation_bits=16), ids)
    requant = sequence_logprobs(engine_for(None, quantization="int4", quant_group_size=32), ids)
    assert (native.argmax(-1) == requant.argmax(-1)).float().mean() >= 0.95
    kl = (native.exp() * (native - requant)).sum(-1)
    assert kl.max() < 0.02
