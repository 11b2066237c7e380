"""Quantized KV cache: storage round trips, attention on quantized K/V, block counts at a fixed
memory budget, prefix-cache keys, and agreement with the unquantized cache."""

from __future__ import annotations

import pytest
import torch
from helpers.quantization import engine_for, teacher_forced_top1

from tachyllm.backends.torch_backend import PrefillSpan, TorchBackend, TorchMetadata, paged_attention
from tachyllm.eval.greedy import greedy_tokens as greedy
from tachyllm.kernels.kv_quant import KV_STORAGE, QuantizedKV, qmax

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paged attention stores keys", "0123456789 numbers"]


HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _quantized(dtype: torch.dtype, slots: int, amax: float) -> QuantizedKV:
    data = torch.zeros(slots, KV_HEADS, HEAD_DIM, dtype=dtype)
    return QuantizedKV(data, torch.full((KV_HEADS, 1), amax / qmax(dtype)))


# Relative error bounds per element: fp8 e4m3 keeps 3 mantissa bits (<= 2^-4 relative rounding),
# e5m2 keeps 2 bits (2^-3); int8 is an absolute step of amax/127, checked separately.
@pytest.mark.parametrize("name, rel", [("fp8", 2**-4), ("fp8_e5m2", 2**-3)])
def test_fp8_round_trip(name, rel):
    cache = _quantized(KV_STORAGE[name], 8, 4.0)
    x = torch.randn(3, KV_HEADS, HEAD_DIM).clamp(-4, 4)
    slots = torch.tensor([5, 0, 2])
    cache.write(slots, x)
    back = cache.read(slots, torch.float32)
    big = x.abs() > 0.05  # tiny values land in fp8 subnormals, where the bound is absolute
    assert ((back - x).abs()[big] <= rel * x.abs()[big] + 1e-6).all()
    assert cache.read(torch.tensor([[1, 5]]), torch.bfloat16).shape == (1, 2, KV_HEADS, HEAD_DIM)


def test_int8_round_trip_and_saturation():
    cache = _quantized(torch.int8, 4, 2.0)
    x = torch.randn(2, KV_HEADS, HEAD_DIM).clamp(-2, 2)
    x[0, 0, 0] = 50.0  # beyond the calibrated range: saturates instead of wrapping around
    cache.write(torch.tensor([1, 3]), x)
    back = cache.read(torch.tensor([1, 3]), torch.float32)
    assert back[0, 0, 0] == pytest.approx(2.0)
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[0, 0, 0] = False
    assert ((back - x).abs()[rest] <= 2.0 / 127 / 2 + 1e-6).all()


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_paged_attention_on_quantized_cache_is_close_to_plain(name):
    torch.manual_seed(0)
    n = 12
    q, k, v = torch.randn(n, HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
    slots = torch.arange(n)
    backend = TorchBackend(torch.device("cpu"))
    meta = TorchMetadata(backend=backend, slot_mapping=slots, prefills=[PrefillSpan(0, n, slots, 0)])
    plain = torch.zeros(1, 16, KV_HEADS, HEAD_DIM)
    ref = paged_attention(q, k, v, plain, plain.clone(), meta, HEAD_DIM**-0.5)
    dtype = KV_STORAGE[name]
    kc, vc = _quantized(dtype, 16, 5.0), _quantized(dtype, 16, 5.0)
    out = paged_attention(q, k, v, kc, vc, meta, HEAD_DIM**-0.5)
    assert float((out - ref).norm() / ref.norm()) < 0.05
    # Decode path: one more query token reading the quantized context.
    meta_d = TorchMetadata(
        backend=backend, slot_mapping=torch.tensor([n]), num_decode_tokens=1,
        decode_slots=torch.arange(n + 1).unsqueeze(0), decode_bias=torch.zeros(1, 1, 1, 1, n + 1),
    )  # fmt: skip
    out_d = paged_attention(q[:1], k[:1], v[:1], kc, vc, meta_d, HEAD_DIM**-0.5)
    assert torch.isfinite(out_d).all()


def test_blocks_at_fixed_memory_and_prefix_key(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    memory = 4 << 20
    bf16 = engine_for(path, kv_cache_memory=memory)
    fp32 = engine_for(path, kv_cache_memory=memory, dtype="float32")
    fp8 = engine_for(path, kv_cache_memory=memory, kv_cache_dtype="fp8")
    int8_fp32 = engine_for(path, kv_cache_memory=memory, dtype="float32", kv_cache_dtype="int8")
    blocks = lambda e: e.block_manager.num_blocks  # noqa: E731
    assert blocks(fp8) == 2 * blocks(bf16)
    assert blocks(int8_fp32) == 4 * blocks(fp32)
    assert bf16._prefix_cache_key() == b"torch.bfloat16"  # unchanged for the default configuration
    assert fp8._prefix_cache_key() != bf16._prefix_cache_key()


def test_kv_dtype_logged(tiny_model_factory, caplog):
    with caplog.at_level("INFO", logger="tachyllm"):
        engine_for(str(tiny_model_factory("llama")), kv_cache_dtype="fp8_e5m2")
    assert "KV cache dtype fp8_e5m2: 2.0x the blocks of bfloat16" in caplog.text
    assert "calibrated per layer and KV head" in caplog.text


# Teacher-forced top-1 agreement with the bf16-cache engine (see test_quantization.py for why tiny
# models are not judged by greedy text). Calibrated per-head scales keep fp8 e4m3 and int8 close;
# e5m2 has one mantissa bit less.
TINY_TOP1 = {"fp8": 0.85, "int8": 0.85, "fp8_e5m2": 0.7}


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "int8"])
def test_tiny_model_quantized_kv_agrees(tiny_model_factory, kv):
    path = str(tiny_model_factory("llama"))
    assert teacher_forced_top1(path, kv_cache_dtype=kv) >= TINY_TOP1[kv]
    assert all(len(t) == 8 for t in greedy(engine_for(path, kv_cache_dtype=kv), PROMPTS, 8))


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_default_model_quantized_kv_agrees(kv):
    """Judged teacher-forced (0.94-0.97 measured on AVX-512 and AVX2 builds): greedy text is not a
    fair measure, since one flipped token early in a continuation (where depends on the host's
    kernels) counts every later position as a disagreement."""
    assert teacher_forced_top1(None, kv_cache_dtype=kv) >= 0.9
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]
    ref = greedy(engine_for(None), prompts, 24)
    out = greedy(engine_for(None, kv_cache_dtype=kv), prompts, 24)
    assert [len(t) for t in out] == [24] * 4 and sum(o[0] == r[0] for o, r in zip(out, ref)) >= 3


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_cache_cold_and_warm_agree(tiny_model_factory, kv):
    """A prompt whose prefix comes from the cache computes what it computed cold: with a quantized
    cache the first prefill chunk also attends to its K/V as stored (read back), not to the fresh
    values, so a prefix-cache hit changes nothing but the work done."""
    from helpers.hf_reference import mixed_prompts

    from tachyllm import LLM, SamplingParams

    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", kv_cache_dtype=kv, max_num_batched_tokens=16,
              kv_cache_memory=4 << 20)  # fmt: skip
    prompts = mixed_prompts(300, lengths=(5, 40, 9, 23), seed=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    stats = llm.engine.scheduler.stats
    cold = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hits = stats.prefix_cache_hits
    warm = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert stats.prefix_cache_hits > hits  # the second pass did reuse cached blocks
    assert warm == cold
