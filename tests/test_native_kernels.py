"""The C++ kernels (tachyllm/kernels/csrc) against plain PyTorch, and the engine with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tachyllm.backends.cpu_backend import CpuBackend, CpuLayerOps
from tachyllm.kernels import native
from tachyllm.models.layers import GatedMLP, RMSNorm, RotaryEmbedding

ops = native.native_ops()
pytestmark = pytest.mark.native
KERNEL_OPS = CpuLayerOps(ops) if ops is not None else None  # the cpu backend's; the layers' default is PyTorch's

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_rotary_and_activation_match_eager(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5, KERNEL_OPS).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    eager_norm = RMSNorm(96, 1e-5).to(dtype)
    eager_norm.weight = norm.weight
    x, residual = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype)
    torch.testing.assert_close(norm(x), eager_norm(x), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    expected = eager_norm.add_and_norm(x.clone(), residual.clone())
    got = norm.add_and_norm(x.clone(), residual.clone())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])

    # q and k as row-strided views of one fused projection output, as the model has them.
    rotary = RotaryEmbedding(32, 64, 10000.0, None, torch.device("cpu"), dtype, KERNEL_OPS)
    eager_rotary = RotaryEmbedding(32, 64, 10000.0, None, torch.device("cpu"), dtype)
    qkv = torch.randn(5, (4 + 2 * 2) * 32, dtype=dtype)
    positions = torch.tensor([0, 3, 9, 63, 17])
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    expected_q, expected_k = eager_rotary(positions, q.reshape(5, 4, 32), k.reshape(5, 2, 32))
    rotary(positions, q.view(5, 4, 32), k.view(5, 2, 32))  # in place
    torch.testing.assert_close(qkv[:, :128].view(5, 4, 32), expected_q, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    torch.testing.assert_close(qkv[:, 128:192].view(5, 2, 32), expected_k, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    with pytest.raises(RuntimeError, match="position out of range"):
        rotary(torch.tensor([64, 0, 0, 0, 0]), q.view(5, 4, 32), k.view(5, 2, 32))

    gate_up = torch.randn(6, 2 * 40, dtype=dtype)
    g, u = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(g) * u, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_mlp_uses_kernel_and_matches_eager():
    torch.manual_seed(1)
    mlp = GatedMLP(32, 48, KERNEL_OPS)
    for p in mlp.parameters():
        p.data.normal_(0, 0.2)
    eager_mlp = GatedMLP(32, 48)
    eager_mlp.load_state_dict(mlp.state_dict())
    x = torch.randn(3, 32)
    torch.testing.assert_close(mlp(x), eager_mlp(x))


def _reference_attention(q, k_cache, v_cache, tables, info, scale):
    """Naive attention: query j of sequence b sees positions 0 .. start + j of its block table."""
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q, dtype=torch.float32)
    for b, (first, count, start) in enumerate(info.tolist()):
        positions = torch.arange(start + count)
        slots = tables[b].long()[positions // block_size] * block_size + positions % block_size
        keys = k_cache.reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        values = v_cache.reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        for j in range(count):
            visible = start + j + 1
            scores = torch.einsum("hd,thd->ht", q[first + j].float() * scale, keys[:visible])
            out[first + j] = torch.einsum("ht,thd->hd", scores.softmax(-1), values[:visible])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, block_size", [(16, 4), (64, 16), (128, 32), (24, 8)])
def test_paged_attention_matches_reference(dtype, head_dim, block_size):
    """Decodes, a verification of draft tokens, a prefill from position 0 and a chunk after cached
    context, in one batch: query tiles, partial key tiles, blocks shorter and longer than a tile."""
    torch.manual_seed(2)
    blocks, kv_heads, heads = 64, 2, 6
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    counts_starts = [(1, 13), (4, 6), (1, 0), (23, 0), (37, 3 * block_size + 5)]
    first_rows = [0, 1, 5, 6, 29]
    info = torch.tensor([[f, c, s] for f, (c, s) in zip(first_rows, counts_starts)], dtype=torch.int32)
    width = max(-(-(c + s) // block_size) for c, s in counts_starts)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in counts_starts]).to(torch.int32)
    q = torch.randn(66 + 2, heads, head_dim, dtype=dtype)  # two trailing rows stand for other tokens
    out = torch.full_like(q, 7.0)
    ops.paged_attention(out, q, k_cache, v_cache, tables, info, head_dim**-0.5)
    expected = _reference_attention(q, k_cache, v_cache, tables, info, head_dim**-0.5)
    tol = TOLERANCE.get(dtype, 2e-3)
    torch.testing.assert_close(out[:66].float(), expected[:66], rtol=tol, atol=tol)
    assert (out[66:] == 7.0).all(), "rows of other tokens must stay untouched"


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2"])
def test_write_kv_quantizes_like_the_pytorch_path(name):
    """write_kv into an int8 / fp8 cache stores exactly the codes QuantizedKV.write stores (divide by
    the head's scale, saturate, round half to even / convert), and needs the scales."""
    from tachyllm.kernels.kv_quant import KV_STORAGE, QuantizedKV

    torch.manual_seed(5)
    kv_heads, head_dim, block_size, blocks = 3, 64, 16, 4
    k = torch.randn(7, kv_heads, head_dim, dtype=torch.bfloat16) * 3
    v = torch.randn(7, kv_heads, head_dim, dtype=torch.bfloat16)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-8])  # saturation and tiny values
    slots = torch.tensor([5, 0, 17, 63, 2, 40, 33])
    scales = torch.tensor([[0.01], [0.02], [0.05]])
    dtype = KV_STORAGE[name]
    ref_k, ref_v = (
        QuantizedKV(torch.zeros(blocks * block_size, kv_heads, head_dim, dtype=dtype), scales, block_size)
        for _ in range(2)
    )
    ref_k.write(slots, k), ref_v.write(slots, v)
    kc, vc = (
        torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype),
        torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype),
    )
    ops.write_kv(k, v, kc, vc, slots, scales.view(-1), scales.view(-1))
    assert torch.equal(kc.view(torch.uint8), ref_k.paged().view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_v.paged().view(torch.uint8))
    with pytest.raises(RuntimeError, match="one scale per KV head"):
        ops.write_kv(k, v, kc, vc, slots)


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_reads_quantized_caches(storage, q_dtype):
    """An int8 / fp8 cache with a scale per KV head, read in place: the same as the kernel over its
    dequantized fp32 copy (every stored code, fp8 subnormals and negatives included, appears), for
    decodes, a chunk after cached context and a context long enough to be split; bad scales fail."""
    torch.manual_seed(4)
    blocks, block_size, kv_heads, heads, head_dim = 96, 16, 2, 6, 64
    codes = torch.randint(0, 256, (2, blocks, block_size, kv_heads, head_dim), dtype=torch.uint8)
    if storage == torch.int8:
        stored = codes.view(torch.int8)
    else:  # any byte but NaN
        stored = codes.view(storage).float().nan_to_num(0.0).clamp(-200, 200).to(storage)
    k_cache, v_cache = stored[0], stored[1]
    k_scale, v_scale = torch.tensor([0.02, 0.05]), torch.tensor([0.01, 0.03])
    deq_k = k_cache.float() * k_scale.view(1, 1, -1, 1)
    deq_v = v_cache.float() * v_scale.view(1, 1, -1, 1)
    counts_starts = [(1, 40), (1, 1100), (9, 3 * block_size + 5)]
    first_rows = [0, 1, 2]
    info = torch.tensor([[f, c, s] for f, (c, s) in zip(first_rows, counts_starts)], dtype=torch.int32)
    width = max(-(-(c + s) // block_size) for c, s in counts_starts)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in counts_starts]).to(torch.int32)
    q = torch.randn(11, heads, head_dim, dtype=q_dtype)
    out = torch.empty_like(q)
    ops.paged_attention(out, q, k_cache, v_cache, tables, info, 0.125, k_scale, v_scale)
    expected = torch.empty(q.shape)
    ops.paged_attention(expected, q.float(), deq_k, deq_v, tables, info, 0.125)
    tol = TOLERANCE[q_dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    # A context of one position returns its value row: every code converts exactly.
    all_codes = torch.arange(256, dtype=torch.uint8).view(2, 1, kv_heads, head_dim)  # two positions' rows
    one = v_cache.clone()
    one.view(torch.uint8)[:2, 0] = all_codes[:, 0]
    single = torch.tensor([[0, 1, 0], [1, 1, 0]], dtype=torch.int32)
    rows = torch.empty(2, heads, head_dim)
    ops.paged_attention(rows, torch.zeros(2, heads, head_dim), k_cache, one,
                        torch.tensor([[0], [1]], dtype=torch.int32), single, 0.125, k_scale, v_scale)  # fmt: skip
    exact = one[:2, 0].float() * v_scale.view(1, -1, 1)
    finite = exact.isfinite()  # NaN / infinity codes aside: writes saturate, never store them
    assert torch.equal(rows.view(2, kv_heads, heads // kv_heads, head_dim)[:, :, 0][finite], exact[finite])
    with pytest.raises(RuntimeError, match="one scale per KV head"):
        ops.paged_attention(out, q, k_cache, v_cache, tables, info, 0.125)
    with pytest.raises(RuntimeError, match="one scale per KV head"):
        ops.paged_attention(out, q, k_cache, v_cache, tables, info, 0.125, k_scale[:1], v_scale)


def test_paged_attention_splits_long_contexts_across_threads():
    """Long contexts are split into segments computed in parallel and merged (flash-decoding); the
    result must not depend on the thread count nor on the rest of the batch, to the bit."""
    torch.manual_seed(3)
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    counts_starts = [(1, 1500), (3, 2000), (1, 40)]
    widths = [-(-(c + s) // block_size) for c, s in counts_starts]
    blocks = sum(widths)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    order = torch.randperm(blocks).to(torch.int32)
    tables = torch.zeros(len(widths), max(widths), dtype=torch.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = order[sum(widths[:i]) : sum(widths[:i]) + w]
    info = torch.tensor([[0, 1, 1500], [1, 3, 2000], [4, 1, 40]], dtype=torch.int32)
    q = torch.randn(5, heads, head_dim, dtype=torch.bfloat16)
    expected = _reference_attention(q, k_cache, v_cache, tables, info, 0.125)
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            ops.paged_attention(out, q, k_cache, v_cache, tables, info, 0.125)
            results.append(out.float())
    finally:
        torch.set_num_threads(saved)
    torch.testing.assert_close(results[0], expected, rtol=2e-2, atol=2e-2)
    assert all(torch.equal(results[0], out) for out in results[1:])
    # Each sequence alone (a batch this small splits its work by KV head too): the same bits.
    for b, (first, count, _) in enumerate(info.tolist()):
        alone = torch.empty_like(q)
        ops.paged_attention(
            alone, q, k_cache, v_cache, tables[b : b + 1].contiguous(), info[b : b + 1].contiguous(), 0.125
        )
        assert torch.equal(alone[first : first + count].float(), results[0][first : first + count])


def test_write_kv_and_bad_inputs():
    k_cache, v_cache = torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)
    kv = torch.randn(3, 2, 8)  # [tokens, k and v, head_dim] -> strided views per head
    k, v = kv[:, :1], kv[:, 1:]
    ops.write_kv(k, v, k_cache, v_cache, torch.tensor([5, 0, 7]))
    flat_k, flat_v = k_cache.view(-1, 1, 8), v_cache.view(-1, 1, 8)
    torch.testing.assert_close(flat_k[[5, 0, 7]], k)
    torch.testing.assert_close(flat_v[[5, 0, 7]], v)
    assert flat_k[[1, 2, 3, 4, 6]].abs().sum() == 0
    with pytest.raises(RuntimeError, match="cache slot out of range"):
        ops.write_kv(k, v, k_cache, v_cache, torch.tensor([5, 0, 8]))
    q, out = torch.randn(1, 2, 8), torch.empty(1, 2, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_attention(
            out,
            q,
            k_cache,
            v_cache,
            torch.tensor([[4]], dtype=torch.int32),
            torch.tensor([[0, 1, 0]], dtype=torch.int32),
            1.0,
        )
    with pytest.raises(RuntimeError, match="block table too short"):
        ops.paged_attention(
            out,
            q,
            k_cache,
            v_cache,
            torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([[0, 1, 2]], dtype=torch.int32),
            1.0,
        )


def _greedy(path, prompts, backend: str, **kwargs):
    from tachyllm import LLM, SamplingParams

    llm = LLM(
        model=str(path), dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=32, backend=backend, **kwargs
    )
    assert llm.engine.backend.name == backend
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    "arch, kv_cache_dtype", [("llama", "auto"), ("qwen3", "auto"), ("llama", "int8"), ("llama", "fp8")]
)
def test_engine_same_tokens_with_and_without_kernels(tiny_model_factory, arch, kv_cache_dtype):
    """Mixed prefill chunks and decodes, n-gram speculation (several queries per decode); Qwen3's
    q/k norms run before the in-place rotary; int8 / fp8 caches read in place by the kernel."""
    tiny_llama = tiny_model_factory(arch)
    prompts = ["hello hello hello hello", "def add(a, b): return a + b " * 3, "x"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    with_kernels = _greedy(tiny_llama, prompts, "cpu", speculative_config=spec, kv_cache_dtype=kv_cache_dtype)
    assert _greedy(tiny_llama, prompts, "torch", speculative_config=spec, kv_cache_dtype=kv_cache_dtype) == with_kernels


@pytest.mark.parametrize(
    "quantization, activation_bits, kv_cache_dtype",
    [(None, 16, "auto"), ("int4", 16, "auto"), ("int4", 8, "auto"), (None, 16, "fp8")],
)
def test_fused_decode_layer_matches_the_module_path(
    tiny_model_factory, quantization, activation_bits, kv_cache_dtype, monkeypatch
):
    """Decode-only steps run each layer as one C++ DecodeLayer call, chaining the kernels the
    modules call: in bf16 (and int4, with either activation rounding; and an fp8 cache) the tokens
    and their logprobs are identical."""
    from tachyllm import LLM, SamplingParams

    # The fused layer chains the kernels the linears run; without them here it is never built.
    backend = CpuBackend(torch.device("cpu"))
    if quantization is None and backend.bf16_linear_kernels() is None:
        pytest.skip("the bf16 linears run the C++ kernel only with AVX512-BF16 or AVX2 + FMA")
    if quantization == "int4" and backend.block_kernels() is None:
        pytest.skip("needs the C++ block kernels (AVX-512 VNNI)")
    path = str(tiny_model_factory("llama"))
    prompts = ["hello hello hello hello", "def add(a, b): return a + b " * 3, "x"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(CpuBackend, "fused_decoder_layer", lambda self, layer, rotary: None)
        llm = LLM(model=path, dtype="bfloat16", quantization=quantization,
                  quant_group_size=32 if quantization else None, quant_activation_bits=activation_bits,
                  kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 22, speculative_config=spec)  # fmt: skip
        outs = llm.generate(prompts, params)
        runs.append([(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs])
        if fused:
            assert all(layer.fused is not None for layer in llm.engine.model.layers), "the fused path never ran"
    assert runs[0] == runs[1]
