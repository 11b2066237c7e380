"""Pre-quantized HF checkpoints (AWQ GEMM, GPTQ v1/v2, compressed-tensors) read as stored and run on
the packed kernels: the weights equal the format's reference formula exactly, greedy output equals
the same model dequantized to fp32, and unsupported variants are one error naming the field."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers.prequantized_files import Scheme, write_prequantized

from tachyllm.backends import create_backend
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.errors import ConfigError, ModelLoadError
from tachyllm.eval.greedy import greedy_tokens
from tachyllm.loading import load_checkpoint
from tachyllm.quantization.gguf_packed import GGUFLinear
from tachyllm.quantization.int4 import Int4Linear
from tachyllm.quantization.prequantized import PermutedInput, build

BLOCK_KERNELS = create_backend("auto", torch.device("cpu")).block_kernels()
PROMPTS = ["The quick brown fox", "def add(a, b):", "Paged attention stores keys"]

SCHEMES = {
    "awq-g32": Scheme("awq", group=32),
    "awq-g64": Scheme("awq", group=64),
    "awq-g128": Scheme("awq", group=128),
    "gptq4-sym": Scheme("gptq", group=64, sym=True),
    "gptq4-asym-v1": Scheme("gptq", group=32),
    "gptq4-asym-v2": Scheme("gptq_v2", group=64),
    "gptq4-act-order": Scheme("gptq", group=32, sym=True, act_order=True),
    "gptq4-channel": Scheme("gptq", group=-1),
    "gptq8-sym": Scheme("gptq", bits=8, group=32, sym=True),
    "gptq8-sym-act-order": Scheme("gptq", bits=8, group=64, sym=True, act_order=True),
    "gptq8-asym": Scheme("gptq", bits=8, group=64),
    "ct-w4a16-sym": Scheme("ct_packed", group=32, sym=True, scale_dtype=torch.bfloat16),
    "ct-w4a16-asym": Scheme("ct_packed", group=64),
    "ct-w4a16-channel": Scheme("ct_packed", group=-1, sym=True),
    "ct-w4a16-act-order": Scheme("ct_packed", group=32, sym=True, act_order=True),
    "ct-w8a16": Scheme("ct_packed", bits=8, group=-1, sym=True),
    "ct-w8a8": Scheme("ct_int", bits=8, group=-1, sym=True, scale_dtype=torch.bfloat16),
    "ct-w8a8-fp32-scales": Scheme("ct_int", bits=8, group=-1, sym=True, scale_dtype=torch.float32),
    "ct-naive-w4-asym": Scheme("ct_naive", group=32),
}
# fp32 scales do not fit the kernels' fp16 block scales: rounded (logged), so not greedy-identical.
GREEDY_EXACT = [name for name in SCHEMES if name != "ct-w8a8-fp32-scales"]
# What each 8-bit / odd layout runs on; 4-bit is always Int4Linear.
EXPECTED = {
    "gptq8-sym": GGUFLinear,
    "gptq8-sym-act-order": GGUFLinear,
    "ct-w8a16": GGUFLinear,
    "ct-w8a8": GGUFLinear,
    "ct-w8a8-fp32-scales": GGUFLinear,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from helpers.models import make_tiny_model

    # 128-wide inputs so that groups of 128 fit (and 64 / 32 give 2 / 4 groups per row).
    return make_tiny_model(tmp_path_factory.mktemp("base"), hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory):
    made: dict[str, tuple[Path, Path, dict]] = {}

    def get(name: str) -> tuple[Path, Path, dict]:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            refs = write_prequantized(base, root / "quantized", root / "reference", SCHEMES[name])
            made[name] = (root / "quantized", root / "reference", refs)
        return made[name]

    return get


def engine(path: Path, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(path), dtype="float32", max_num_seqs=4, max_model_len=128, threads=1, **kwargs)
    )


@pytest.mark.parametrize("name", list(SCHEMES))
def test_weights_equal_the_reference_exactly(checkpoints, name):
    quantized, _, refs = checkpoints(name)
    ckpt = load_checkpoint(str(quantized))
    assert ckpt.prequantized is not None and len(ckpt.prequantized.modules) == len(refs)
    weights = dict(ckpt.weights())
    # fp16 / bf16 scales: exact in fp32 (11 + 8 significant bits); fp32 scales: correctly rounded.
    for key, ref in refs.items():
        assert torch.equal(weights[key], ref.float()), key


@pytest.mark.native
@pytest.mark.skipif(BLOCK_KERNELS is None, reason="needs the C++ block kernels (AVX-512 VNNI)")
@pytest.mark.parametrize("name", GREEDY_EXACT)
def test_greedy_equals_the_dequantized_fp32_model(checkpoints, name, caplog):
    quantized, reference, _ = checkpoints(name)
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        eng = engine(quantized)
    layers = [m for m in eng.model.modules() if isinstance(m, Int4Linear | GGUFLinear)]
    expected = EXPECTED.get(name, Int4Linear)
    if name == "gptq8-asym":
        # No exact packed path for 8-bit with zero points: dequantized, said once per reason.
        assert not layers
        assert "8-bit with zero points (the Q8_0 kernel has no min term): dequantized" in caplog.text
    else:
        assert len(layers) == 4 * 2 and all(isinstance(m, expected) for m in layers)  # qkv, o, gate_up, down x 2
        permuted = [m for m in eng.model.modules() if isinstance(m, PermutedInput)]
        assert bool(permuted) == SCHEMES[name].act_order
    if name == "ct-w8a8":
        assert "activations quantized as int8 token in the checkpoint run unquantized" in caplog.text
    assert greedy_tokens(eng, PROMPTS, 12) == greedy_tokens(engine(reference), PROMPTS, 12)


@pytest.mark.native
@pytest.mark.skipif(BLOCK_KERNELS is None, reason="needs the C++ block kernels (AVX-512 VNNI)")
@pytest.mark.skipif(BLOCK_KERNELS is None, reason="needs the C++ block kernels (AVX-512 VNNI)")
@pytest.mark.parametrize("scheme", [Scheme("gptq", group=32, act_order=True), Scheme("awq", group=64)])
def test_biased_projections_qwen2(tmp_path, scheme):
    """Qwen2's q/k/v biases stay dense tensors beside the packed weights and reach the fused module."""
    from helpers.models import make_tiny_model

    base = make_tiny_model(tmp_path / "base", "qwen2", hidden_size=128, intermediate_size=256)
    write_prequantized(base, tmp_path / "q", tmp_path / "ref", scheme)
    eng = engine(tmp_path / "q")
    qkv = eng.model.layers[0].self_attn.qkv_proj
    assert (qkv.inner if isinstance(qkv, PermutedInput) else qkv).bias is not None
    assert greedy_tokens(eng, PROMPTS, 12) == greedy_tokens(engine(tmp_path / "ref"), PROMPTS, 12)


def test_fp16_block_rounding_is_logged(checkpoints, caplog):
    """Symmetric fp16 / bf16-scaled layers are held exactly (nothing logged); fp32 scales and
    asymmetric mins (-s * z) are rounded to the blocks' fp16, and the largest change is logged."""
    for name, rounded in [("gptq4-sym", False), ("ct-w8a8", False), ("ct-w8a8-fp32-scales", True), ("awq-g32", True)]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tachyllm"):
            engine(checkpoints(name)[0])
        assert ("in fp16: weights move by up to" in caplog.text) == rounded, name


@pytest.mark.native
@pytest.mark.skipif(BLOCK_KERNELS is None, reason="needs the C++ block kernels (AVX-512 VNNI)")
def test_packed_layer_matches_its_reference_matmul(checkpoints):
    """The act-order layer (columns permuted, activations gathered) computes x @ W_ref^T."""
    quantized, _, refs = checkpoints("gptq4-act-order")
    weights = load_checkpoint(str(quantized)).prequantized
    name = "model.layers.0.mlp.down_proj"
    built = build([weights.read(name)], None, BLOCK_KERNELS)
    assert isinstance(built.module, PermutedInput)
    x = torch.randn(5, refs[f"{name}.weight"].shape[1])
    ref = x.double() @ refs[f"{name}.weight"].t()
    assert torch.allclose(built.module(x).double(), ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


def test_quantization_must_match_the_checkpoint(checkpoints, base):
    quantized, _, _ = checkpoints("gptq4-sym")
    with pytest.raises(ConfigError, match="quantization='int4' does not match .*quant_method = gptq"):
        engine(quantized, quantization="int4")
    with pytest.raises(ConfigError, match="quant_group_size does not apply to a pre-quantized checkpoint"):
        engine(checkpoints("awq-g32")[0], quantization="awq", quant_group_size=64)
    with pytest.raises(ConfigError, match="quantization='gptq' needs a pre-quantized checkpoint"):
        engine(base, quantization="gptq")
    with pytest.raises(ConfigError, match="quant_activation_bits applies to quantized weights"):
        engine(base, quant_activation_bits=8)
    assert engine(quantized, quantization="gptq", quant_activation_bits=8) is not None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"quant_method": "fp8"}, "quantization_config.quant_method = fp8 is not supported"),
        ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method = bitsandbytes is not supported"),
        ({"bits": 3}, "quantization_config.bits = 3 is not supported"),
        ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format = marlin is not supported"),
        ({"is_marlin_format": True}, "quantization_config.is_marlin_format = true is not supported"),
        ({"pack_dtype": "int64"}, "quantization_config.pack_dtype = int64 is not supported"),
    ],
)
def test_unsupported_gptq_variants_are_one_error(checkpoints, tmp_path, change, message):
    _expect_error(checkpoints("gptq4-sym")[0], tmp_path, change, message)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": "gemv"}, "quantization_config.version = gemv is not supported"),
        ({"version": "exllama"}, "quantization_config.version = exllama is not supported"),
        ({"bits": 8}, "quantization_config.bits = 8 is not supported .*4 for awq"),
        ({"zero_point": False}, "quantization_config.zero_point = false is not supported"),
    ],
)
def test_unsupported_awq_variants_are_one_error(checkpoints, tmp_path, change, message):
    _expect_error(checkpoints("awq-g32")[0], tmp_path, change, message)


def _ct(weights: dict | None = None, **top) -> dict:
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    return {
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**w, **(weights or {})}}},
        **top,
    }


@pytest.mark.parametrize(
    "change, message",
    [
        (_ct(format="nvfp4-pack-quantized"), "quantization_config.format = nvfp4-pack-quantized is not supported"),
        (_ct(format="float-quantized"), "quantization_config.format = float-quantized is not supported"),
        (_ct(format="marlin-24"), "quantization_config.format = marlin-24 is not supported"),
        (_ct({"type": "float"}), r"quantization_config.config_groups.group_0.weights.type = float is not supported"),
        (_ct({"num_bits": 2}), r"config_groups.group_0.weights.num_bits = 2 is not supported"),
        (_ct({"strategy": "block"}), r"config_groups.group_0.weights.strategy = block is not supported"),
        (_ct(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config.format = sparse-24-bitmask"),
    ],
)
def test_unsupported_compressed_tensors_variants_are_one_error(checkpoints, tmp_path, change, message):
    _expect_error(checkpoints("ct-w4a16-sym")[0], tmp_path, change, message)


def _expect_error(source: Path, tmp_path: Path, change: dict, message: str) -> None:
    target = tmp_path / "bad"
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).symlink_to(file)
    (target / "config.json").unlink()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"].update(change)
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message) as caught:
        load_checkpoint(str(target))
    assert "\n" not in str(caught.value)


def test_quality_report_against_the_unquantized_original(checkpoints, base, capsys):
    """`tachy eval quality --reference-model`: a pre-quantized checkpoint against the model it came
    from; the labels say what each side ran."""
    from tachyllm.entrypoints.cli import main

    quantized, reference, _ = checkpoints("gptq4-sym")
    argv = ["eval", "quality", "--model", str(quantized), "--seq-len", "32", "--max-sequences", "2", "--threads", "1"]
    assert main([*argv, "--dtype", "float32", "--reference-model", str(reference), "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["config"] == "float32, weights gptq, kv auto"
    assert same["reference"] == f"float32, weights unquantized, kv auto, model {reference}"
    assert same["kl_max"] < 1e-3 and same["top1_agreement"] == 1.0  # the dequantized twin: the same model
    assert main([*argv, "--reference-model", str(base), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kl_mean"] > 10 * same["kl_mean"]  # vs the original: RTN error


def test_compressed_tensors_activation_and_kv_scales_are_not_read(checkpoints, tmp_path):
    """Static activation scales and KV-cache scales of a compressed-tensors checkpoint are skipped
    (weight-only; the KV cache calibrates its own), not an unknown-tensor error."""
    from safetensors.torch import save_file

    source = checkpoints("ct-w8a8")[0]
    target = tmp_path / "with-scales"
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).symlink_to(file)
    extra = {
        "model.layers.0.self_attn.q_proj.input_scale": torch.ones(1),
        "model.layers.0.self_attn.k_scale": torch.ones(1),
        "model.layers.0.self_attn.v_scale": torch.ones(1),
    }
    save_file(extra, target / "scales.safetensors")
    names = {name for name, _ in load_checkpoint(str(target)).weights()}
    assert not names & set(extra) and "model.layers.0.self_attn.q_proj.weight" in names


@pytest.mark.native
@pytest.mark.skipif(BLOCK_KERNELS is None, reason="needs the C++ block kernels (AVX-512 VNNI)")
def test_self_int4_draft_of_a_prequantized_target(checkpoints):
    """speculative 'self:int4' on a pre-quantized checkpoint drafts with its own codes (not an
    int4-vs-gptq mismatch); greedy output stays the target's."""
    quantized = checkpoints("gptq4-sym")[0]
    spec = {"method": "draft_model", "model": "self:int4", "num_speculative_tokens": 2}
    plain = greedy_tokens(engine(quantized), PROMPTS, 12)
    assert greedy_tokens(engine(quantized, speculative_config=spec), PROMPTS, 12) == plain


def test_unset_compressed_tensors_g_idx_means_contiguous_groups(checkpoints, tmp_path):
    """A weight_g_idx of -1s (saved unset, no act-order) reads as contiguous groups."""
    from safetensors.torch import save_file

    source, _, refs = checkpoints("ct-w4a16-sym")
    target = tmp_path / "unset-g-idx"
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).symlink_to(file)
    name = "model.layers.0.mlp.down_proj"
    save_file({f"{name}.weight_g_idx": torch.full((256,), -1, dtype=torch.int32)}, target / "g_idx.safetensors")
    assert torch.equal(
        load_checkpoint(str(target)).prequantized.read(name).dequantize(), refs[f"{name}.weight"].float()
    )


def test_without_the_block_kernels(checkpoints):
    """The torch backend: 4-bit layers on aten's int4 layout, 8-bit ones dequantized; both run."""
    four = engine(checkpoints("gptq4-act-order")[0], backend="torch")
    layers = [m for m in four.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 8 and {m.kernel for m in layers} == {"aten"}
    eight = engine(checkpoints("gptq8-sym")[0], backend="torch")
    assert not [m for m in eight.model.modules() if isinstance(m, Int4Linear | GGUFLinear)]
    assert all(len(t) == 6 for t in greedy_tokens(four, PROMPTS, 6) + greedy_tokens(eight, PROMPTS, 6))


def test_modules_are_built_on_the_model_device(checkpoints):
    """Off the CPU (here the meta device, standing in for CUDA), 4-bit layers take the dequantize
    layout on that device and act-order permutations move with them; 8-bit stays dense."""
    weights = load_checkpoint(str(checkpoints("gptq4-act-order")[0])).prequantized
    meta = torch.device("meta")
    built = build([weights.read("model.layers.0.mlp.down_proj")], None, BLOCK_KERNELS, meta)
    assert isinstance(built.module, PermutedInput) and built.module.perm.device == meta
    assert built.module.inner.kernel == "dequantize" and built.module.inner.packed.device == meta
    eight = load_checkpoint(str(checkpoints("gptq8-sym")[0])).prequantized
    assert build([eight.read("model.layers.0.mlp.down_proj")], None, BLOCK_KERNELS, meta).module is None


@pytest.mark.native
@pytest.mark.skipif(BLOCK_KERNELS is None, reason="activation bits are a mode of the C++ block kernels")
def test_a_prequantized_draft_file_runs_its_own_codes_with_the_given_activation_bits(checkpoints, base, caplog):
    """A pre-quantized checkpoint as the draft of an int4 target: unset, its quantization is its own (as
    for a target; the target's int4 used to be applied to it and refused), and --quant-activation-bits
    reaches its block kernels as it reaches the target's."""
    quantized, _, _ = checkpoints("gptq4-sym")
    spec = {"method": "draft_model", "model": str(quantized), "num_speculative_tokens": 2, "adaptive": False}
    for given in (8, 16):
        with caplog.at_level(logging.INFO, logger="tachyllm"):
            llm = engine(base, quantization="int4", quant_activation_bits=given, speculative_config=spec)
        assert "quantization gptq" in caplog.text
        draft = llm.speculator.proposer.runner.model
        layers = [m for m in draft.modules() if isinstance(m, Int4Linear)]
        assert layers and {m.activation_bits for m in layers} == {given}
        assert greedy_tokens(llm, PROMPTS[:1], 8) == greedy_tokens(
            engine(base, quantization="int4", quant_activation_bits=given), PROMPTS[:1], 8
        )
