"""The Triton paged-attention and KV-write kernels (kernels/triton/paged_attention.py) against a naive
reference: decodes, verifications and prefill chunks (from 0 and after cached context) in one batch,
block sizes, head dims, GQA / MQA, dtypes, quantized caches, sliding windows, split-KV contexts,
batch invariance; and the engine on the cuda backend against the torch backend. Without a GPU (as in
`make test`) everything runs on the CPU in Triton's interpreter; with one, on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles the kernels: they run in numpy on the CPU
pytest.importorskip("triton")

from helpers.hf_reference import mixed_prompts  # noqa: E402
from helpers.paged_attention import DEVICE, FP8, check, check_split_invariance, make_batch  # noqa: E402

from tachyllm import LLM, SamplingParams  # noqa: E402
from tachyllm.backends.cuda_backend import CudaMetadataBuilder  # noqa: E402
from tachyllm.config import EngineConfig  # noqa: E402
from tachyllm.engine.llm_engine import LLMEngine  # noqa: E402
from tachyllm.kernels.kv_quant import QuantizedKV  # noqa: E402
from tachyllm.kernels.triton.paged_attention import KEY_TILE, paged_attention, write_kv  # noqa: E402
from tachyllm.sampling_params import SamplingParams as Params  # noqa: E402
from tachyllm.step import SamplingInput, ScheduledSeq, StepBatch  # noqa: E402

# Mixed: decodes, a verification of 3 drafts, a prefill from 0, a chunk after cached context.
MIXED = [(9, 1), (0, 1), (14, 4), (0, 11), (6, 19), (21, 1)]


# GQA, MQA (a group that is not a power of 2), MHA
@pytest.mark.parametrize("block_size,heads,kv_heads", [(4, 4, 2), (16, 3, 1), (16, 2, 2)])
def test_mixed_batch_matches_reference(block_size, heads, kv_heads):
    check(MIXED, block_size=block_size, heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
def test_head_dims(head_dim):
    check([(5, 1), (3, 6)], head_dim=head_dim, heads=2, kv_heads=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype):
    check(MIXED, dtype=dtype)


@pytest.mark.parametrize(
    "cache_dtype,dtype",
    [(torch.int8, torch.float32), (torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float16)],
)
def test_quantized_caches_read_in_place(cache_dtype, dtype):
    check(MIXED, dtype=dtype, cache_dtype=cache_dtype)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window):
    check(MIXED[:4] + [(40, 1), (30, 20)], window=window, block_size=4)


@pytest.mark.parametrize(
    "window,dtype,cache_dtype", [(None, torch.float32, None), (40, torch.float16, torch.float8_e4m3fn)]
)
def test_split_kv_long_contexts(window, dtype, cache_dtype):
    """Contexts over several segments (shrunk to one key tile): split programs and their merge, decodes
    and chunks, a window cutting segments off. The single-program path gives the same bits, and so
    does each sequence computed alone (batch invariance)."""
    specs = [(100, 1), (3, 1), (60, 3), (40, 12)]
    args, split = check(specs, window=window, dtype=dtype, cache_dtype=cache_dtype, segment=KEY_TILE, block_size=16)
    check_split_invariance(args, split, window, KEY_TILE)


def test_padding_sequences_and_rows_are_untouched():
    """A CUDA graph's padding: sequences with no queries, rows past the last query; strided q."""
    q, kc, vc, bt, qs, sl, _, _ = make_batch([(5, 1), (7, 1)], 4, 2, 64, 4, torch.float32)
    padded_q = torch.zeros(4, 4, 2 * 64, device=DEVICE)[:, :, :64]  # a view with gaps, as a fused qkv split gives
    padded_q[:2] = q
    bt4 = torch.cat([bt, torch.zeros_like(bt)])
    qs4 = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32, device=DEVICE)
    sl4 = torch.cat([sl, torch.zeros_like(sl)])
    out = torch.full((4, 4, 64), 7.0, device=DEVICE)
    paged_attention(padded_q, kc, vc, bt4, qs4, sl4, 0.125, out=out)
    assert torch.equal(out[:2], paged_attention(q, kc, vc, bt, qs, sl, 0.125))
    assert (out[2:] == 7.0).all()


def test_bad_inputs():
    q, kc, vc, bt, qs, sl, _, _ = make_batch([(5, 1)], 4, 2, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="share"):
        paged_attention(q[:, :3], kc, vc, bt, qs, sl, 0.1)
    with pytest.raises(ValueError, match="multiple of"):
        paged_attention(q, kc, vc, bt, qs, sl, 0.1, segment=KEY_TILE + 1)
    with pytest.raises(ValueError, match="do not fit"):
        paged_attention(q, kc, vc, bt, qs[:1], sl, 0.1)
    with pytest.raises(ValueError, match="needs k_scale"):
        paged_attention(q, kc.to(torch.int8), vc.to(torch.int8), bt, qs, sl, 0.1)
    with pytest.raises(ValueError, match="scales given"):
        paged_attention(
            q, kc, vc, bt, qs, sl, 0.1, k_scale=torch.ones(2, device=DEVICE), v_scale=torch.ones(2, device=DEVICE)
        )
    with pytest.raises(ValueError, match="not \\[blocks"):
        paged_attention(q, kc[..., :32], vc[..., :32], bt, qs, sl, 0.1)
    with pytest.raises(ValueError, match="differ"):
        write_kv(q[:, :2], q[:, :2], kc, vc, torch.zeros(2, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, *FP8])
def test_write_kv_matches_quantized_kv_write(cache_dtype):
    """Into a paged cache, skipping negative slots; int8 / fp8 quantized exactly as QuantizedKV.write
    (values at rounding ties and past the saturation limit included)."""
    kv_heads, head_dim, bs, blocks = 3, 64, 4, 6
    gen = torch.Generator().manual_seed(1)
    quant = cache_dtype in (torch.int8, *FP8)
    dtype = torch.float32 if quant else cache_dtype  # a plain cache holds the model dtype
    k = torch.randn(5, kv_heads, head_dim, generator=gen) * 4
    v = torch.randn(5, kv_heads, 2 * head_dim, generator=gen)[:, :, :head_dim] * 4  # strided
    # Ties, saturation, negative values that round to (-)0.
    k[0, 0, :10] = torch.tensor([0.5, 1.5, 2.5, -0.5, 7.5, 1e6, -1e6, 0.0, -1e-4, -0.0]) * 0.05
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.tensor([3, -1, 17, 0, 22])
    scales = (torch.tensor([0.05, 0.1, 0.02]), torch.tensor([0.03, 0.07, 0.2])) if quant else (None, None)
    kc = torch.zeros(blocks, bs, kv_heads, head_dim, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    on_device = [None if t is None else t.to(DEVICE) for t in (k, v, kc, vc, slots, *scales)]
    write_kv(*on_device)
    kc, vc = on_device[2].cpu(), on_device[3].cpu()
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    real = slots >= 0
    for want, x, sc in ((want_k, k, scales[0]), (want_v, v, scales[1])):
        flat = want.view(-1, kv_heads, head_dim)
        if quant:
            QuantizedKV(flat, sc.view(-1, 1)).write(slots[real], x[real])
        else:
            flat[slots[real]] = x[real].to(cache_dtype)
    assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))


# -- the cuda backend ----------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


# fp8 on the GPU only: in the interpreter every step costs seconds.
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"] if ON_GPU else ["auto"])
def test_engine_on_the_cuda_backend_matches_torch(tiny_model_factory, kv_cache_dtype):
    """A tiny fp32 model: mixed prompt lengths, chunked prefill, then the same prompts again on
    cached blocks (prefix-cache hits): the same greedy tokens as the torch backend."""
    path = str(tiny_model_factory("llama"))
    prompts = mixed_prompts(300, lengths=(2, 9, 21), seed=2)
    runs = {}
    for backend in ("torch", "cuda"):
        llm = LLM(path, dtype="float32", device=str(DEVICE), backend=backend, block_size=4, max_num_batched_tokens=16,
                  kv_cache_memory=1 << 20, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        assert llm.engine.backend.name == backend
        runs[backend] = [[o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
                         for _ in range(2)]  # fmt: skip
        assert llm.engine.stats.prefix_cache_hits > 0
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert runs["cuda"] == runs["torch"]
    assert runs["cuda"][0] == runs["cuda"][1]


def test_backend_steps_match_the_torch_backend(tiny_model_factory):
    """Runner level, fp32: prefill chunks (a first one, then one on cached context), a decode with
    draft tokens to verify next to a plain decode; every row's hidden state agrees with the torch backend."""
    path = tiny_model_factory("llama")
    kw = dict(model=str(path), dtype="float32", device=str(DEVICE), block_size=4, kv_cache_memory=1 << 20)
    engines = [LLMEngine(EngineConfig(backend=backend, **kw)) for backend in ("torch", "cuda")]
    a, b = list(range(3, 23)), list(range(40, 70))  # 20 and 30 tokens
    ta, tb = list(range(0, 8)), list(range(8, 18))
    steps = [
        StepBatch([_prefill(1, 0, a[:12], ta, 20, False), _prefill(2, 0, b[:10], tb, 30, False)]),
        StepBatch([_prefill(1, 12, a[12:], ta, 20, True), _prefill(2, 10, b[10:], tb, 30, True)]),
        StepBatch([_decode(1, a + [5], 20, [6, 7], ta), _decode(2, b + [9], 30, [], tb)]),
    ]
    for batch in steps:
        plain, triton = (e.runner.forward(batch) for e in engines)
        torch.testing.assert_close(triton, plain, rtol=1e-4, atol=1e-4)


def _prefill(
    seq_id: int, start: int, tokens: list[int], table: list[int], seq_len: int, completes: bool
) -> ScheduledSeq:
    """A prefill chunk of `tokens` from position `start` (unsampled: the forward alone is compared)."""
    return ScheduledSeq(
        seq_id=seq_id, request_id=str(seq_id), start=start, token_ids=tokens, num_draft_tokens=0,
        block_table=table, seq_len=seq_len, completes=completes,
    )  # fmt: skip


def _decode(seq_id: int, tokens: list[int], start: int, drafts: list[int], table: list[int]) -> ScheduledSeq:
    sampling = SamplingInput(Params(), tokens, len(tokens))
    step = tokens[start : start + 1] + drafts
    return ScheduledSeq(
        seq_id=seq_id, request_id=str(seq_id), start=start, token_ids=step, num_draft_tokens=len(drafts),
        block_table=table, seq_len=len(tokens), completes=True, sampling=sampling,
    )  # fmt: skip


def test_padded_decode_step_equals_unpadded(tiny_model_factory):
    """prepare(batch, pad_to=...) for CUDA graphs: the real rows of a padded decode step (with a
    verification) equal the unpadded step's, padding rows write and read nothing, and the tensors
    sit at the same addresses step after step."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", device=str(DEVICE),
                                    backend="cuda", block_size=4, kv_cache_memory=1 << 20))  # fmt: skip
    runner = engine.runner
    builder: CudaMetadataBuilder = runner.builder
    a, b = list(range(3, 14)), list(range(40, 46))  # 11 and 6 tokens of context
    ta, tb = [5, 1, 7], [2, 9]
    prefill = StepBatch([
        _prefill(1, 0, a[:10], ta, 11, False), _prefill(2, 0, b[:5], tb, 6, False),
    ])  # fmt: skip
    runner.forward(prefill)
    step = StepBatch([_decode(1, a, 10, [], ta), _decode(2, b, 5, [7, 8], tb)])
    with pytest.raises(RuntimeError, match="allocate_graph_buffers"):
        builder.prepare(step, pad_to=4)
    buffers = builder.allocate_graph_buffers(max_num_seqs=8, max_blocks=6, queries_per_seq=3)
    snapshot = [c.clone() for kv in runner.kv_caches for c in kv]
    unpadded = runner.forward(step)
    with torch.inference_mode():
        ids, positions, meta = builder.prepare(step, pad_to=4)
        padded = runner.model(ids, positions, runner.kv_caches, meta)
    assert ids.shape == (12,) and meta.block_tables.shape == (4, 6)
    assert meta.slot_mapping[4:].tolist() == [-1] * 8 and meta.query_start.tolist() == [0, 1, 4, 4, 4]
    assert meta.seq_lens.tolist() == [11, 8, 0, 0]
    assert meta.block_tables[:, :3].tolist() == [ta, tb + [0], [0] * 3, [0] * 3]
    torch.testing.assert_close(padded[:4], unpadded, rtol=1e-5, atol=1e-5)
    # The padded step wrote the same K/V as the unpadded one, and nothing else.
    written = [c.clone() for kv in runner.kv_caches for c in kv]
    runner.forward(step)
    assert all(torch.equal(x, c) for x, c in zip(written, (c for kv in runner.kv_caches for c in kv)))
    assert any(not torch.equal(x, s) for x, s in zip(written, snapshot))
    again = builder.prepare(StepBatch([_decode(2, b, 5, [], tb)]), pad_to=4)
    assert again[0].data_ptr() == ids.data_ptr() and again[2].block_tables.data_ptr() == meta.block_tables.data_ptr()
    assert (
        again[2].query_start.tolist() == [0, 1, 1, 1, 1]
        and again[2].slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    )
    # The tables go up packed to the step's width and are spread into the graph's buffer: the used
    # columns hold this step's tables (padding sequences zeros), whatever a wider step left after them.
    assert again[2].block_tables[:, :2].tolist() == [tb, [0, 0], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="decode-only"):
        builder.prepare(prefill, pad_to=4)
    with pytest.raises(ValueError, match="cannot pad 2 sequences to 1"):
        builder.prepare(step, pad_to=1)
    with pytest.raises(ValueError, match="cannot pad"):
        builder.prepare(step, pad_to=9)


@pytest.mark.slow  # ptxas over every kernel: ~20 s
def test_kernels_compile_for_hopper():
    """Code generation for sm_90 (no GPU needed): what the interpreter cannot check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_aot.py"))], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok ") == 14
