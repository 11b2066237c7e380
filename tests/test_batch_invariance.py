"""Batch invariance of the kernels (docs/determinism.md): a token's result, to the bit, must not
depend on what else its call computes: the other sequences of the batch, how its prompt was cut
into chunks, or which prefix of it came from the cache."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from helpers.gguf_files import random_blocks
from helpers.lora_kernels import lora_linear, seqs

from tachyllm import LLM, SamplingParams
from tachyllm.kernels import native
from tachyllm.kernels.linear import NATIVE_MAX_ROWS, PackedLinear, onednn_packing_available
from tachyllm.lora.layers import StepSegments

ops = native.native_ops()


def _paged_cache(context: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    blocks = -(-context // block_size)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    table = torch.randperm(blocks).to(torch.int32).unsqueeze(0)
    return k_cache, v_cache, table


def _attend(q, k_cache, v_cache, table, pieces: list[tuple[int, int]], scale: float, window: int = 0) -> torch.Tensor:
    """Attention for the queries of one sequence, computed as the given (start, count) pieces, each
    a separate call (as chunked prefill or a decode step would); returns all rows."""
    out = torch.empty_like(q)
    for start, count in pieces:
        info = torch.tensor([[0, count, start]], dtype=torch.int32)
        part = torch.empty_like(q[start : start + count])
        ops.paged_attention(
            part, q[start : start + count].contiguous(), k_cache, v_cache, table, info, scale, window=window
        )
        out[start : start + count] = part
    return out


def _cuts(total: int, size: int, first: int = 0) -> list[tuple[int, int]]:
    pieces = [(0, first)] if first else []
    pieces += [(s, min(size, total - s)) for s in range(first, total, size)]
    return pieces


@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, group", [(64, 3), (128, 1), (64, 8)])
def test_attention_rows_do_not_depend_on_chunking(dtype, head_dim, group):
    """One 1,300-position prompt computed whole, in chunks of 16 / 64 / 500, after a "cached" prefix of
    700 positions, and one query at a time (decodes): the same bits for every query. The context crosses
    the split points at 512 and 1,024 (flash-decoding segments)."""
    torch.manual_seed(0)
    total, kv_heads, block_size = 1300, 2, 16
    k_cache, v_cache, table = _paged_cache(total, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(total, kv_heads * group, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    whole = _attend(q, k_cache, v_cache, table, [(0, total)], scale)
    for pieces in (_cuts(total, 16), _cuts(total, 64), _cuts(total, 500), _cuts(total, 64, first=700)):
        assert torch.equal(_attend(q, k_cache, v_cache, table, pieces, scale), whole), pieces[:3]
    # Decodes: the last queries one per call.
    tail = [(i, 1) for i in range(total - 20, total)]
    assert torch.equal(_attend(q, k_cache, v_cache, table, tail, scale)[total - 20 :], whole[total - 20 :])


@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, block_size", [(40, 16), (512, 16), (700, 24), (1, 16)])
def test_windowed_attention_rows_do_not_depend_on_chunking(dtype, window, block_size):
    """Sliding-window attention (Gemma 3's local layers): a chunk's work starts at the block of its first
    query's window and skips whole segments before it, so a row's first tiles depend on its chunk; every
    row still gets the same bits whole, chunked, after a cached prefix, or as a decode. Block size 24 puts
    segment starts (multiples of 512) inside blocks."""
    torch.manual_seed(2)
    total, kv_heads, group, head_dim = 1300, 1, 4, 64
    k_cache, v_cache, table = _paged_cache(total, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(total, kv_heads * group, head_dim, dtype=dtype)
    whole = _attend(q, k_cache, v_cache, table, [(0, total)], 0.125, window)
    for pieces in (_cuts(total, 16), _cuts(total, 100), _cuts(total, 64, first=700)):
        assert torch.equal(_attend(q, k_cache, v_cache, table, pieces, 0.125, window), whole), pieces[:3]
    tail = [(i, 1) for i in range(total - 20, total)]
    assert torch.equal(_attend(q, k_cache, v_cache, table, tail, 0.125, window)[total - 20 :], whole[total - 20 :])


@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_do_not_depend_on_the_batch(dtype):
    """A decode and a verification of 3 drafts, alone and beside a long prefill chunk and other decodes."""
    torch.manual_seed(1)
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    lengths = [900, 40, 1100, 300]  # context of each sequence
    caches = [_paged_cache(n, block_size, kv_heads, head_dim, dtype) for n in lengths]
    # One cache tensor holding every sequence's blocks, each with its own table.
    k_cache = torch.cat([c[0] for c in caches])
    v_cache = torch.cat([c[1] for c in caches])
    offsets = torch.tensor([0, *[c[0].shape[0] for c in caches]]).cumsum(0)
    width = max(c[2].shape[1] for c in caches)
    tables = torch.zeros(len(caches), width, dtype=torch.int32)
    for i, c in enumerate(caches):
        tables[i, : c[2].shape[1]] = c[2][0] + offsets[i]
    # (queries, start): a decode, a 3-draft verification, a 400-query prefill chunk, another decode.
    shape = [(1, 899), (4, 36), (400, 700), (1, 299)]
    rows = sum(n for n, _ in shape)
    q = torch.randn(rows, heads, head_dim, dtype=dtype)
    firsts = torch.tensor([0, *[n for n, _ in shape]]).cumsum(0)[:-1].tolist()
    info = torch.tensor([[f, n, s] for f, (n, s) in zip(firsts, shape)], dtype=torch.int32)
    batch = torch.empty_like(q)
    ops.paged_attention(batch, q, k_cache, v_cache, tables, info, 0.125)
    for b, (n, s) in enumerate(shape):
        alone = torch.empty_like(q[:n])
        one = torch.tensor([[0, n, s]], dtype=torch.int32)
        ops.paged_attention(
            alone, q[firsts[b] : firsts[b] + n].contiguous(), k_cache, v_cache, tables[b : b + 1], one, 0.125
        )
        assert torch.equal(alone, batch[firsts[b] : firsts[b] + n]), b


@pytest.mark.native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 40])
def test_encoder_attention_rows_do_not_depend_on_the_step(dtype, head_dim):
    """An encoder input's attention alone, packed with inputs of other lengths (longer and shorter than
    the kernel's 8-query blocks and 16-key vectors), and with another thread count."""
    lengths = [5, 1, 16, 17, 40, 3, 130]
    heads, rows = 3, sum(lengths) + 9  # 9 rows of step padding after the inputs
    q, k, v = torch.randn(rows, 3, heads, head_dim).to(dtype).unbind(1)  # views of one fused projection
    starts = torch.tensor([0, *lengths]).cumsum(0)
    packed = torch.empty(q.shape, dtype=dtype)
    ops.encoder_attention(packed, q, k, v, starts, 0.2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        again = torch.empty_like(packed)
        ops.encoder_attention(again, q, k, v, starts, 0.2)
        assert torch.equal(again, packed)
    finally:
        torch.set_num_threads(threads)
    for first, n in zip(starts.tolist(), lengths):
        alone = torch.empty(n, heads, head_dim, dtype=dtype)
        ops.encoder_attention(alone, *(t[first : first + n] for t in (q, k, v)), torch.tensor([0, n]), 0.2)
        assert torch.equal(alone, packed[first : first + n]), n


def _linear_rows_invariant(layer: torch.nn.Module, in_features: int, dtype: torch.dtype) -> None:
    x = torch.randn(300, in_features, dtype=dtype)
    whole = layer(x)
    for rows in (1, 2, 3, 5, 7, 11, 16, 47, 48, 49, 64, 129):
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows
        assert torch.equal(layer(x[rows - 1]), whole[rows - 1]), rows  # a lone 1-D row


@pytest.mark.skipif(not onednn_packing_available(torch.float32), reason="oneDNN unavailable")
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (96, 64)])
def test_float32_linear_rows_do_not_depend_on_the_row_count(shape):
    """float32 linears are batch invariant without the deterministic mode (oneDNN, a lone row computed as two)."""
    torch.manual_seed(2)
    out_features, in_features = shape
    linear = torch.nn.Linear(in_features, out_features)
    _linear_rows_invariant(PackedLinear(linear), in_features, torch.float32)


@pytest.mark.native
@pytest.mark.skipif(not (ops and ops.bf16_linear_vectorized), reason="the bf16 kernel is a scalar loop here")
@pytest.mark.parametrize("shape", [(576, 1536), (1728, 576), (49152 // 16, 576)])
def test_bf16_linear_rows_do_not_depend_on_the_row_count_when_batch_invariant(shape):
    torch.manual_seed(3)
    out_features, in_features = shape
    linear = torch.nn.Linear(in_features, out_features, dtype=torch.bfloat16)
    _linear_rows_invariant(PackedLinear(linear, ops, batch_invariant=True), in_features, torch.bfloat16)
    # Not batch invariant, rows above the kernel's limit go to oneDNN: another summation order.
    fast = PackedLinear(linear, ops)
    if not onednn_packing_available(torch.bfloat16):  # no such limit: F.linear is not faster here
        assert fast.max_kernel_rows is None
        return
    x = torch.randn(NATIVE_MAX_ROWS + 72, in_features, dtype=torch.bfloat16)
    assert not torch.equal(fast(x)[:48], fast(x[:48])), "the fast path was expected to switch implementations"


@pytest.mark.native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prequantized_act_order_rows_do_not_depend_on_the_row_count(bits, dtype):
    """A pre-quantized GPTQ act-order layer (activations gathered by the permutation, then the int4 /
    Q8_0 block kernel), tests/test_prequantized.py: each row alone gives the same bits."""
    from tachyllm.loading.hf_quantized import PackedLinear as Stored
    from tachyllm.quantization.prequantized import PermutedInput, build

    torch.manual_seed(4)
    out_features, in_features, group = 96, 256, 64
    zeros = torch.full((out_features, in_features // group), 2 ** (bits - 1), dtype=torch.int32)
    stored = Stored(
        torch.randint(0, 2**bits, (out_features, in_features), dtype=torch.int32),
        torch.rand(out_features, in_features // group).half().float() / 50,
        zeros,
        torch.randperm(in_features) // group,
        bits,
    )
    layer = build([stored], None, ops).module
    assert isinstance(layer, PermutedInput)
    _linear_rows_invariant(layer, in_features, dtype)


@pytest.mark.native
@pytest.mark.skipif(ops is None, reason="the C++ kernels did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_segment_kernel_rows_do_not_depend_on_the_batch(dtype):
    """An adapter row's LoRA output, to the bit, alone and in a step with other rows of its adapter,
    other adapters and base rows (the segment kernel sums each output in one order); on bf16, with the
    adapters' weights stored bf16."""
    step = [(1, 3), (0, 2), (2, 4), (1, 5), (3, 1)]
    segments = StepSegments(torch.device("cpu"), ops, dtype)
    linear = lora_linear(576, [576, 192, 192], dtype, segments)
    x = torch.randn(sum(n for _, n in step), 576).to(dtype)
    base = torch.randn(x.shape[0], 960).to(dtype)  # the base linear's output, the same for every call
    together = base.clone()
    segments.set_step(seqs(step))
    linear.native.apply(together, x, segments.native)
    row = 0
    for slot, n in step:
        for i in range(n):
            alone = base[row + i : row + i + 1].clone()
            segments.set_step(seqs([(slot, 1)]))
            linear.native.apply(alone, x[row + i : row + i + 1], segments.native)
            assert torch.equal(alone[0], together[row + i]), (slot, i)
        row += n
    assert not torch.equal(together, base)


@pytest.mark.native
@pytest.mark.skipif(not (ops and ops.quant_gemv_isa() != "scalar"), reason="no AVX-512 VNNI block kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [16, 8])
def test_gguf_block_kernels_rows_do_not_depend_on_the_row_count(dtype, bits):
    """Every GGUF block type the kernels take, stacked in one call as a fused layer's parts would be."""
    rng = np.random.default_rng(4)
    in_features, parts = 512, [(kind, 16 * (i + 1) + i) for i, kind in enumerate(ops.quant_gguf_formats())]
    packed = torch.cat([
        ops.quant_pack_gguf(kind, torch.from_numpy(random_blocks(GGMLQuantizationType(kind), rows, in_features, rng)),
                            in_features)
        for kind, rows in parts
    ])  # fmt: skip
    layout = torch.tensor(parts)
    _linear_rows_invariant(lambda x: ops.quant_gemv(x, packed, layout, bits), in_features, dtype)


# -- the engine ----------------------------------------------------------------------------------

# head_dim 64 (the bf16 pair path of the attention kernel), one KV head; long enough for contexts past
# the attention kernel's 512-position segments.
INVARIANT_MODEL = dict(
    hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=256, max_position_embeddings=2048
)
MODES = [("float32", False, None), ("bfloat16", True, None), ("bfloat16", True, "int4")]


def _prompts(count: int) -> list[list[int]]:
    """Token-id prompts from 20 to 700 tokens; the first half share a 100-token head (prefix-cache
    hits on the second request), a few repeat a phrase (n-gram drafts find matches)."""
    rng = random.Random(7)
    head = [rng.randrange(5, 390) for _ in range(100)]
    prompts = []
    for i in range(count):
        length = [20, 60, 150, 700][i % 4]
        tail = [rng.randrange(5, 390) for _ in range(length)]
        if i % 3 == 0:
            phrase = tail[:7]
            tail = (phrase * (length // 7 + 1))[:length]
        prompts.append(head + tail if i < count // 2 else tail)
    return prompts


def _engine(path, dtype: str, deterministic: bool, quantization: str | None, **options) -> LLM:
    settings = dict(
        dtype=dtype, deterministic=deterministic, quantization=quantization, block_size=16, kv_cache_memory=32 << 20
    )
    return LLM(str(path), **{**settings, **options})


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _alone(llm: LLM, prompts, params) -> list[list[int]]:
    return [_tokens(llm, [p], params)[0] for p in prompts]


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
}


@pytest.mark.native
@pytest.mark.parametrize("dtype, deterministic, quantization", MODES)
def test_outputs_do_not_depend_on_cache_chunking_batch_or_preemption(
    tiny_model_factory, dtype, deterministic, quantization
):
    """Greedy and seeded outputs, token for token: the reference runs each prompt alone, unchunked,
    without prefix caching; then cold and warm prefix cache, chunks of 16 and 64 tokens, all 32 prompts
    in one batch, and a KV cache so small that the batch is preempted."""
    path = tiny_model_factory("llama", **INVARIANT_MODEL)
    prompts = _prompts(32)
    plain = _engine(path, dtype, deterministic, quantization, enable_prefix_caching=False, enable_chunked_prefill=False)
    reference = {name: _alone(plain, prompts, params) for name, params in PARAMS.items()}

    cached = _engine(path, dtype, deterministic, quantization)
    for name, params in PARAMS.items():
        assert _alone(cached, prompts, params) == reference[name], f"{name}: cold cache"
        assert _alone(cached, prompts, params) == reference[name], f"{name}: warm cache"
    assert cached.engine.stats.prefix_cache_hits > 0
    for budget in (16, 64):
        chunked = _engine(
            path, dtype, deterministic, quantization, max_num_batched_tokens=budget, enable_prefix_caching=False
        )
        for name, params in PARAMS.items():
            assert _alone(chunked, prompts, params) == reference[name], f"{name}: chunks of {budget}"
    batched = _engine(path, dtype, deterministic, quantization)
    for name, params in PARAMS.items():
        assert _tokens(batched, prompts, params) == reference[name], f"{name}: a batch of 32"
    small = _engine(path, dtype, deterministic, quantization, kv_cache_memory=900 << 10)
    for name, params in PARAMS.items():
        assert _tokens(small, prompts, params) == reference[name], f"{name}: preempted"
    assert small.engine.stats.num_preemptions > 0


@pytest.mark.native
@pytest.mark.parametrize("dtype, deterministic, quantization", MODES)
def test_greedy_outputs_do_not_depend_on_speculation(tiny_model_factory, dtype, deterministic, quantization):
    """n-gram drafts verified in the batch (several positions per sequence) give the tokens of plain decoding."""
    path = tiny_model_factory("llama", **INVARIANT_MODEL)
    prompts = _prompts(16)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)  # long enough to fall into loops
    plain = _tokens(_engine(path, dtype, deterministic, quantization), prompts, params)
    spec = _engine(
        path,
        dtype,
        deterministic,
        quantization,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    )
    assert _tokens(spec, prompts, params) == plain
    assert spec.engine.stats.spec_num_draft_tokens > 0
