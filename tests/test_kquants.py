"""GGUF block types kept packed (kernels/csrc/quant_gemv.cpp, quantization/gguf_packed.py): every
type a real Q4_K_M / Q5_K_M file holds (Q4_K, Q5_K, Q6_K, Q5_0, Q8_0, and Q4_0 / Q4_1) against the
gguf package's dequantization, stacked parts of different types, bad input, and a tiny Q4_K_M-like
model end to end against the same file dequantized to fp32."""

from __future__ import annotations

import json
import logging
import os
import statistics

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from helpers.engine import gguf_engine
from helpers.gguf_files import (
    HALF_FIELDS,
    Q4_K_M_LIKE,
    TYPES,
    random_blocks,
    write_mixed_gguf,
)
from helpers.quantization import EXACT_RTOL, UNROUNDED_RTOL, round_activations

from tachyllm import LLM, SamplingParams
from tachyllm.backends.cpu_backend import CpuBackend
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.eval.quality import describe, sequence_logprobs
from tachyllm.kernels import native
from tachyllm.quantization import activation_bits
from tachyllm.quantization.apply import module_bytes
from tachyllm.quantization.calibration import calibration_windows, next_token_kl
from tachyllm.quantization.gguf_packed import GGUFEmbedding, GGUFLinear
from tachyllm.quantization.int4 import Int4Linear

ops = native.native_ops()
pytestmark = [
    pytest.mark.native,
    pytest.mark.skipif(
        ops is None or ops.quant_gemv_isa() == "scalar", reason="needs the C++ block kernels with AVX-512 VNNI or AVX2"
    ),
]

T = GGMLQuantizationType


def _packed(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles, the gguf package's dequantized [rows, cols] weight in float64) of random valid blocks."""
    raw = random_blocks(kind, rows, cols, np.random.default_rng(seed))
    weight = torch.from_numpy(dequantize(raw, kind).reshape(rows, cols)).double()
    return ops.quant_pack_gguf(int(kind), torch.from_numpy(raw), cols), weight


def _layout(*parts: tuple[GGMLQuantizationType, int]) -> torch.Tensor:
    return torch.tensor([[int(kind), rows] for kind, rows in parts])


def test_every_q4_k_m_type_has_a_kernel():
    assert set(TYPES) == {T(t) for t in ops.quant_gguf_formats()}


@pytest.mark.parametrize("kind", TYPES)
def test_packed_weights_are_the_gguf_dequantization(kind):
    """Each input alone (x = 127 at one position: its rounding to int8 is exact) reads one weight
    column back: every weight equals the gguf package's to fp32 rounding of the scale products (a
    wrong code or scale would be off by at least one quantization step)."""
    rows, cols = 37, 512  # 3 tiles (the last one partial), 2 super-blocks of 256 per row
    packed, weight = _packed(kind, rows, cols)
    for bits in (16, 8):
        columns = ops.quant_gemv(torch.eye(cols) * 127, packed, _layout((kind, rows)), bits).double() / 127
        torch.testing.assert_close(columns, weight.t(), rtol=1e-6, atol=1e-6 * weight.abs().max().item())


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [16, 8])
def test_kernel_matches_the_dequantized_matmul(kind, rows, dtype, bits):
    torch.manual_seed(rows)
    out_f, in_f = 45, 768
    packed, weight = _packed(kind, out_f, in_f, seed=rows)
    x = torch.randn(rows, in_f).to(dtype)
    y = ops.quant_gemv(x, packed, _layout((kind, out_f)), bits)
    assert y.dtype == dtype and y.shape == (rows, out_f)
    rel = (y.double() - round_activations(x, bits) @ weight.t()).norm() / (
        round_activations(x, bits) @ weight.t()
    ).norm()
    assert rel < EXACT_RTOL[dtype]
    reference = x.double() @ weight.t()
    assert (y.double() - reference).norm() / reference.norm() < UNROUNDED_RTOL[bits] + EXACT_RTOL[dtype]


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("bits", [16, 8])
def test_batched_rows_have_the_bits_of_one_row(kind, bits):
    """The batched path (rows sharing each decoded weight block) gives every row the bits it gets
    alone, whatever the row count, and the gguf package's dequantized product in fp32."""
    out_f, in_f = 37, 512  # a partial last tile, 2 super-blocks of 256
    packed, weight = _packed(kind, out_f, in_f, seed=7)
    layout = _layout((kind, out_f))
    x = torch.randn(64, in_f, generator=torch.Generator().manual_seed(bits))
    alone = torch.cat([ops.quant_gemv(x[r : r + 1], packed, layout, bits) for r in range(64)])
    for rows in (1, 2, 3, 5, 6, 7, 9, 13, 17, 64):  # passes of 4 (Q4_K on AVX-512: 6) rows or fewer, as equal as can be
        assert torch.equal(ops.quant_gemv(x[:rows], packed, layout, bits), alone[:rows]), rows
    reference = round_activations(x, bits) @ weight.t()
    assert (alone.double() - reference).norm() / reference.norm() < EXACT_RTOL[torch.float32]


def _extreme_blocks(kind: GGMLQuantizationType, fill: int, rows: int, cols: int) -> np.ndarray:
    """Random fp16 scales, every other byte (codes, sub-block scales and mins) set to `fill`."""
    raw = random_blocks(kind, rows, cols, np.random.default_rng(fill))
    block, size = GGML_QUANT_SIZES[kind]
    keep = np.zeros(size, dtype=bool)
    for at in HALF_FIELDS[kind][0]:
        keep[at : at + 2] = True
    blocks = raw.reshape(rows, -1, size)
    blocks[..., ~keep] = fill
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", TYPES)
def test_largest_codes_and_activations_do_not_overflow(kind):
    """Every code at its largest (or Q8_0's most negative) against activations of the largest
    magnitude, and ones whose residual rounds to -128: sums in narrow integers would wrap."""
    out_f, in_f = 16, 256
    x = torch.tensor([127.0, -127.0, 1.5, -126.5]).repeat_interleave(in_f).view(4, in_f)
    x[2:, ::32] = 127.0  # each 32-block's scale 1: 1.5 and -126.5 round with the residual -128 / 256
    for fill in (0xFF, 0x80, 0x7F):
        raw = _extreme_blocks(kind, fill, out_f, in_f)
        weight = torch.from_numpy(dequantize(raw, kind).reshape(out_f, in_f)).double()
        packed = ops.quant_pack_gguf(int(kind), torch.from_numpy(raw), in_f)
        for bits in (16, 8):
            y = ops.quant_gemv(x, packed, _layout((kind, out_f)), bits).double()
            reference = round_activations(x, bits) @ weight.t()
            torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def test_stacked_parts_of_different_types():
    """A fused q/k/v whose parts the file stores as Q4_K, Q5_0 and Q6_K: one call, the activations
    rounded once, each part's columns the bits of that part alone."""
    parts = [(T.Q4_K, 64), (T.Q5_0, 37), (T.Q6_K, 45), (T.Q8_0, 16)]
    packed = [_packed(kind, rows, 256, seed=i) for i, (kind, rows) in enumerate(parts)]
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    whole = ops.quant_gemv(x, torch.cat([p for p, _ in packed]), _layout(*parts))
    alone = [ops.quant_gemv(x, p, _layout(part)) for (p, _), part in zip(packed, parts, strict=True)]
    assert torch.equal(whole, torch.cat(alone, dim=1))
    reference = round_activations(x, 16) @ torch.cat([w for _, w in packed]).t()
    assert (whole.double() - reference).norm() / reference.norm() < EXACT_RTOL[torch.bfloat16]


def test_q4_1_and_q8_0_blocks_pack_like_their_decoded_codes():
    """The file's Q4_1 / Q8_0 blocks give the tiles quant_pack_q4_1 / quant_pack_q8_0 make from the
    decoded codes (the default model's layers and head run on exactly the bytes they did)."""
    rng = np.random.default_rng(3)
    raw = random_blocks(T.Q4_1, 20, 128, rng).reshape(20, 4, 20)
    d, m = (torch.from_numpy(raw[..., a : a + 2].copy().view(np.float16)[..., 0].astype(np.float32)) for a in (0, 2))
    codes = torch.from_numpy(np.concatenate([raw[..., 4:] & 0xF, raw[..., 4:] >> 4], -1).reshape(20, 128))
    assert torch.equal(ops.quant_pack_gguf(int(T.Q4_1), torch.from_numpy(raw.reshape(20, -1)), 128),
                       ops.quant_pack_q4_1(codes, d, m))  # fmt: skip
    raw = random_blocks(T.Q8_0, 20, 128, rng).reshape(20, 4, 34)
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = torch.from_numpy(raw[..., 2:].copy().view(np.int8).reshape(20, 128))
    assert torch.equal(ops.quant_pack_gguf(int(T.Q8_0), torch.from_numpy(raw.reshape(20, -1)), 128),
                       ops.quant_pack_q8_0(codes, d))  # fmt: skip


def test_bad_blocks_and_layouts_are_refused():
    packed, _ = _packed(T.Q4_K, 16, 256)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="unknown block format 7"):
        ops.quant_gemv(x, packed, _layout((T.Q5_1, 16)))
    with pytest.raises(RuntimeError, match="multiple of 256 for block format 12, got 96"):
        ops.quant_gemv(torch.randn(2, 96), packed, _layout((T.Q4_K, 16)))
    with pytest.raises(RuntimeError, match="do not match out_features=32"):
        ops.quant_gemv(x, packed, _layout((T.Q4_K, 16), (T.Q4_K, 16)))
    with pytest.raises(RuntimeError, match=r"layout must be int64 \[parts, 2\]"):
        ops.quant_gemv(x, packed, torch.tensor([12, 16]))
    with pytest.raises(RuntimeError, match="no kernel for GGML block type 7"):
        ops.quant_pack_gguf(int(T.Q5_1), torch.zeros(16, 24, dtype=torch.uint8), 32)
    with pytest.raises(RuntimeError, match="144 bytes per row expected"):
        ops.quant_pack_gguf(int(T.Q4_K), torch.zeros(16, 140, dtype=torch.uint8), 256)
    with pytest.raises(RuntimeError, match="multiple of 256 for block type 14"):
        ops.quant_pack_gguf(int(T.Q6_K), torch.zeros(16, 210, dtype=torch.uint8), 128)


# -- a tiny Q4_K_M-like model ---------------------------------------------------------------------


def test_q4_k_m_like_model_runs_packed_and_matches_fp32(tmp_path, caplog):
    """Every matrix on its own blocks (fused q/k/v and gate/up mixing types, the Q6_K head), and the
    log-probs of the same file dequantized to fp32 within the 16-bit activation rounding."""
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        packed = gguf_engine(path, quantization="gguf", quant_activation_bits=16)
    model = packed.model
    assert "lm_head: the file's Q6_K blocks (lm_head.weight), C++ kernel" in caplog.text
    assert "no packed kernel" not in caplog.text
    assert isinstance(model.lm_head, GGUFLinear)
    assert model.layers[0].self_attn.qkv_proj.block_types == "Q4_K+Q4_K+Q6_K"
    assert model.layers[1].mlp.gate_up_proj.block_types == "Q4_0+Q4_1"
    assert all(isinstance(m, GGUFLinear) for layer in model.layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))  # fmt: skip
    # A decode step streams the tiles (~the file's bytes), not a dequantized copy (fp32 here), and
    # not the embedding table: the file has a head of its own, so the table is only gathered from.
    reference = gguf_engine(path)
    tiles = sum(module_bytes(m) for m in model.modules() if isinstance(m, GGUFLinear))
    norms = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "norm" in name)
    assert packed.weight_bytes == tiles + norms
    fp32_elements = sum(int(t.n_elements) for t in GGUFReader(path).tensors if t.name != "token_embd.weight")
    assert reference.weight_bytes == 4 * fp32_elements
    assert packed.weight_bytes < reference.weight_bytes / 4
    ids = [(i * 37) % 250 + 3 for i in range(40)]
    lp, lp_ref = sequence_logprobs(packed, ids), sequence_logprobs(reference, ids)
    assert (lp.argmax(-1) == lp_ref.argmax(-1)).float().mean() >= 0.95  # near-ties may flip
    assert (lp - lp_ref).abs().max() < 2e-3


def _bits(engine: LLMEngine) -> set[int]:
    return {m.activation_bits for m in engine.model.modules() if isinstance(m, GGUFLinear)}


def test_gguf_activation_bits_given_are_used_and_logged(tmp_path, caplog, monkeypatch):
    """Given bits are used without the load-time check and logged; 8 bits stray further from the fp32
    reference than 16 but keep its top tokens. Without the block kernels (the torch backend) nothing
    is rounded or checked, and 8 bits asked for say so."""
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    monkeypatch.setattr(activation_bits, "check_8_bits", lambda *args: pytest.fail("checked although given"))
    fine = gguf_engine(path, quantization="gguf", quant_activation_bits=16)
    assert _bits(fine) == {16}
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        coarse_engine = gguf_engine(path, quantization="gguf", quant_activation_bits=8)
    assert _bits(coarse_engine) == {8}
    assert "quant_activation_bits 8: 9 layers round activations to int8 per 32 inputs, as llama.cpp does" in caplog.text
    ids = [(i * 37) % 250 + 3 for i in range(40)]
    lp_ref = sequence_logprobs(gguf_engine(path), ids)
    coarse, close = ((sequence_logprobs(e, ids) - lp_ref).abs().mean() for e in (coarse_engine, fine))
    assert close < coarse
    assert (sequence_logprobs(coarse_engine, ids).argmax(-1) == lp_ref.argmax(-1)).float().mean() >= 0.9
    assert describe(coarse_engine) == "float32, weights gguf (activations 8-bit), kv auto"
    assert describe(fine) == "float32, weights gguf, kv auto"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        gguf_engine(path, quantization="gguf", backend="torch")
    assert "activations rounded" not in caplog.text and "has no effect" not in caplog.text
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        gguf_engine(path, quantization="gguf", backend="torch", quant_activation_bits=8)
    assert "quant_activation_bits 8 has no effect: no layer runs the C++ block kernels" in caplog.text


def test_the_load_time_check_measures_what_8_bits_move(tmp_path):
    """The check's per-window KL is KL(16-bit || 8-bit) of the engines' own next-token distributions
    on the calibration windows; it leaves the model at 16 bits (the caller sets what it decides)."""
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    engines = {bits: gguf_engine(path, quantization="gguf", quant_activation_bits=bits) for bits in (8, 16)}
    model = engines[16].model
    tokenizer = engines[16].tokenizer
    windows = calibration_windows(model, tokenizer, activation_bits.CHECK_TOKENS, activation_bits.CHECK_WINDOWS)
    assert activation_bits.check_windows(model, tokenizer) == windows
    check = activation_bits.check_8_bits(model, windows)
    assert _bits(engines[16]) == {16}
    assert len(check.window_kls) == len(windows) >= 2 and check.tokens == sum(len(w) - 1 for w in windows)
    for ids, kl in zip(windows, check.window_kls):
        lp16, lp8 = (sequence_logprobs(engines[b], ids)[:-1] for b in (16, 8))
        assert kl == pytest.approx(
            float(next_token_kl(lp16, lp8).mean()), rel=0.1
        )  # torch vs C++ attention: some roundings flip
    assert check.kl > 0


def test_the_check_is_kept_between_starts(tmp_path, monkeypatch, caplog):
    """A file's check is measured once and kept in the cache directory: a later start decides from the
    stored KLs (and says so); a changed file, another dtype, other layers on blocks (--quant-skip),
    shorter windows (--max-model-len) or a damaged entry are measured again, and with the cache off
    every start measures."""
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    monkeypatch.setenv("TACHY_CACHE_DIR", str(tmp_path / "cache"))
    runs = []
    real = activation_bits.check_8_bits
    monkeypatch.setattr(activation_bits, "check_8_bits", lambda model, windows: runs.append(1) or real(model, windows))
    first = gguf_engine(path, quantization="gguf")
    windows = activation_bits.check_windows(first.model, first.tokenizer)
    entry = activation_bits.stored_check_path(str(path), first.model, windows)
    assert len(runs) == 1 and entry.is_file() and entry.parent.parent == tmp_path / "cache"
    for stored_kl, expected in ((0.5, 16), (0.0, 8)):
        entry.write_text(json.dumps({"window_kls": [stored_kl] * activation_bits.CHECK_WINDOWS, "tokens": 508,
                                     "seconds": 1.0}))  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tachyllm"):
            assert _bits(gguf_engine(path, quantization="gguf")) == {expected}
        assert "at an earlier start, kept in" in caplog.text and len(runs) == 1
    for damaged in ("{not json", json.dumps({"window_kls": [], "tokens": 0, "seconds": 0})):
        entry.write_text(damaged)
        gguf_engine(path, quantization="gguf")
        assert len(json.loads(entry.read_text())["window_kls"]) == activation_bits.CHECK_WINDOWS
    assert len(runs) == 3
    for other in (dict(dtype="bfloat16"), dict(quant_skip="mlp"), dict(max_model_len=48)):
        gguf_engine(path, quantization="gguf", **other)
    assert len(runs) == 6
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    gguf_engine(path, quantization="gguf")
    assert len(runs) == 7
    assert len(list(entry.parent.glob("*.json"))) == 1  # a file's stale entries are dropped
    monkeypatch.setenv("TACHY_CACHE_DIR", "off")
    gguf_engine(path, quantization="gguf")
    gguf_engine(path, quantization="gguf")
    assert len(runs) == 9


def test_one_outlying_window_does_not_decide_the_rounding():
    """The median window decides: a few tokens of one window (Qwen2.5-Coder-0.5B's measured 0.034 beside
    0.002s) do not cost a model its 8 bits, a model off in most windows (Gemma-3-270M's) keeps 16."""
    one_outlier = activation_bits.ActivationCheck([0.0024, 0.0341, 0.0021, 0.0018], 508, 1.0)
    assert statistics.mean(one_outlier.window_kls) > activation_bits.KL_BOUND
    assert one_outlier.bits == 8
    assert activation_bits.ActivationCheck([0.0112, 0.0178, 0.0130, 0.0415], 508, 1.0).bits == 16


@pytest.mark.parametrize("bound, expected", [(0.0, 16), (float("inf"), 8)])
def test_unset_gguf_activation_bits_follow_the_check(tmp_path, caplog, monkeypatch, bound, expected):
    """Unset, a GGUF file's blocks take 8 bits when the check's KL is within the bound, else 16: every
    block layer, the fused decode layers included (the same tokens as the module path), logged with
    the measured KL. Other formats keep 16 unchecked."""
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    monkeypatch.setattr(activation_bits, "KL_BOUND", bound)
    options = dict(quantization="gguf", dtype="bfloat16", max_model_len=128, threads=1)
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        checked = LLM(str(path), **options)
    assert _bits(checked.engine) == {expected}
    within = "within" if expected == 8 else "above"
    assert f"activations rounded to {expected} bits per 32 inputs in 9 layers" in caplog.text
    assert "calibration windows" in caplog.text and f"{within} the {bound:.2f} bound" in caplog.text
    # Decode steps run the fused layers, built after the check: the same log-probs as given bits.
    given = LLM(str(path), **options, quant_activation_bits=expected)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = ["def add(a, b):", "hello hello"]
    runs = [[o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (checked, given)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [o.logprobs for o in runs[0]] == [o.logprobs for o in runs[1]]

    monkeypatch.setattr(activation_bits, "check_8_bits", lambda *args: pytest.fail("checked"))
    int4_layers = [m for m in gguf_engine(path, quantization="int4").model.modules() if isinstance(m, Int4Linear)]
    assert int4_layers and {m.activation_bits for m in int4_layers} == {16}


def test_a_quantized_kv_cache_calibrates_with_the_table_on_its_blocks(tmp_path):
    """KV-scale calibration runs the model before any request: with the embedding table on the
    file's blocks (no dense weight to take the dtype from) it calibrates and the engine generates."""
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    llm = LLM(str(path), quantization="gguf", kv_cache_dtype="int8", max_model_len=128, threads=1)
    assert isinstance(llm.engine.model.embed_tokens, GGUFEmbedding)
    out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("bits", [8, 16])
def test_fused_decode_layer_runs_the_block_kernels(tmp_path, monkeypatch, bits):
    """In bf16, decode steps run each layer as one DecodeLayer call over the mixed-type linears:
    the same tokens and log-probs as the module path, at either activation rounding."""
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = ["hello hello hello", "def add(a, b):", "x"]
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(CpuBackend, "fused_decoder_layer", lambda self, layer, rotary: None)
        llm = LLM(
            model=str(path), dtype="bfloat16", quantization="gguf", quant_activation_bits=bits, kv_cache_memory=1 << 22
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs])
        if fused:
            assert all(layer.fused is not None for layer in llm.engine.model.layers), "the fused path never ran"
    assert runs[0] == runs[1]


def test_types_without_a_kernel_are_dequantized_with_one_log_line(tmp_path, caplog):
    layers = [dict(Q4_K_M_LIKE[0], ffn_up=T.Q5_1), dict(Q4_K_M_LIKE[1], attn_output=T.F16)]
    path = write_mixed_gguf(tmp_path / "mixed.gguf", layers, head=T.F16)
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        model = gguf_engine(path, quantization="gguf").model
    lines = [r.getMessage() for r in caplog.records if "no packed kernel" in r.getMessage()]
    assert lines == [
        "gguf: 2 layers dequantized to torch.float32, no packed kernel for their block types: "
        "layers.0.mlp.gate_up_proj (Q5_1), layers.1.self_attn.o_proj (F16)"
    ]
    assert "lm_head: lm_head.weight (F16 in the file) dequantized to torch.float32" in caplog.text
    assert not isinstance(model.layers[0].mlp.gate_up_proj, GGUFLinear)
    assert isinstance(model.layers[0].mlp.down_proj, GGUFLinear)


def test_layers_on_the_files_blocks_are_never_loaded_dense(tmp_path, monkeypatch):
    """Loading leaves out the tensors of every layer that runs on the file's blocks: they are never
    dequantized, and the model computes exactly what it computed when they were loaded first and then
    replaced. A fused layer with one part of a type without a kernel (Q5_1) loads all its parts."""
    import tachyllm.loading.gguf as gguf_loading
    import tachyllm.runner.model_loader as model_loader

    monkeypatch.setenv("TACHY_CACHE_DIR", "off")  # every build parses the file (no entry to read from)
    layers = [dict(Q4_K_M_LIKE[0], ffn_up=T.Q5_1), Q4_K_M_LIKE[1]]
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", layers, head=T.Q6_K)
    dequantized = []
    to_torch = gguf_loading._to_torch

    def recording(tensor, name, config):
        dequantized.append(name)
        return to_torch(tensor, name, config)

    monkeypatch.setattr(gguf_loading, "_to_torch", recording)
    packed = gguf_engine(path, quantization="gguf")
    matrices = {n for n in dequantized if n.endswith("_proj.weight")}
    assert matrices == {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    assert "lm_head.weight" not in dequantized and "model.embed_tokens.weight" not in dequantized
    assert not isinstance(packed.model.layers[0].mlp.gate_up_proj, GGUFLinear)
    assert isinstance(packed.model.embed_tokens, GGUFEmbedding)

    dequantized.clear()
    monkeypatch.setattr(model_loader, "gguf_layers_from_file", lambda *args: {})  # load everything, as before
    loaded_first = gguf_engine(path, quantization="gguf")
    assert "lm_head.weight" in dequantized
    ids = [(i * 37) % 250 + 3 for i in range(40)]
    assert torch.equal(sequence_logprobs(packed, ids), sequence_logprobs(loaded_first, ids))


def test_a_layer_left_unloaded_must_be_replaced(tmp_path, monkeypatch):
    """If loading left out a layer that quantization then did not take from the file, its weights are
    garbage: the build refuses to go on."""
    import tachyllm.runner.model_loader as model_loader

    layers = [dict(Q4_K_M_LIKE[0], ffn_up=T.Q5_1)]
    path = write_mixed_gguf(tmp_path / "q5_1.gguf", layers, head=T.Q6_K)
    keys = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    monkeypatch.setattr(model_loader, "gguf_layers_from_file", lambda *args: {"layers.0.mlp.gate_up_proj": keys})
    with pytest.raises(RuntimeError, match=r"not replaced by them: \['layers.0.mlp.gate_up_proj'\]"):
        gguf_engine(path, quantization="gguf")


@pytest.mark.parametrize("cache", ["miss", "hit"])
def test_a_packed_start_parses_the_file_once(tmp_path, monkeypatch, cache):
    """The GGUF's metadata (its whole vocabulary, seconds for a real one) is parsed once per packed
    start: loading keeps the tensor table for the layers on the file's blocks. On a cache hit loading
    does not parse the file, so the blocks' table is parsed there. The kept table gives the logprobs
    a parse of its own gives."""
    import tachyllm.loading.gguf as gguf_loading
    import tachyllm.runner.model_loader as model_loader

    monkeypatch.setenv("TACHY_CACHE_DIR", str(tmp_path / "cache"))
    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    if cache == "hit":
        gguf_engine(path)  # a dense start writes the cache entry
    parses = []
    reader = gguf_loading._Reader

    def counting(*args, **kwargs):
        parses.append(args)
        return reader(*args, **kwargs)

    monkeypatch.setattr(gguf_loading, "_Reader", counting)
    packed = gguf_engine(path, quantization="gguf")
    assert len(parses) == 1
    assert isinstance(packed.model.layers[0].self_attn.qkv_proj, GGUFLinear)
    monkeypatch.setattr(gguf_loading, "_Reader", reader)
    if cache == "hit":
        return  # the blocks' table came from a parse of its own, as it always did
    parse_again = model_loader.gguf_matrices  # as before: the blocks' table from a parse of their own
    monkeypatch.setattr(model_loader, "gguf_matrices", lambda path, config, stored: parse_again(path, config))
    ids = [(i * 37) % 250 + 3 for i in range(40)]
    assert torch.equal(sequence_logprobs(packed, ids), sequence_logprobs(gguf_engine(path, quantization="gguf"), ids))


def test_dequantizing_in_slices_of_rows_gives_the_gguf_packages_values(tmp_path, monkeypatch):
    """Loading dequantizes a large tensor a slice of rows at a time (loading/gguf.py): the same values
    as the gguf package dequantizing it whole, for every block type, slices that do not divide the rows."""
    import tachyllm.loading.gguf as gguf_loading

    path = write_mixed_gguf(tmp_path / "q4_k_m.gguf", Q4_K_M_LIKE, head=T.Q6_K)
    monkeypatch.setattr(gguf_loading, "DEQUANTIZE_ROWS", 7)
    types = set()
    for tensor in GGUFReader(str(path)).tensors:
        want = dequantize(tensor.data, tensor.tensor_type)
        got = gguf_loading._dequantize(tensor.data, tensor.tensor_type)
        assert got.shape == want.shape and np.array_equal(got, want), tensor.name
        types.add(tensor.tensor_type)
    assert {T.Q4_K, T.Q6_K, T.Q8_0, T.F32} <= types
