"""The engine on a CUDA device: the cuda backend (Triton attention, CUDA graphs; `auto` picks it),
the portable torch backend, and host-sync-free sampling. Skipped where no GPU is present, as in CI;
run on a GPU machine with `pytest tests/test_cuda.py` (benchmarks/gpu_check.sh does;
tests/test_triton_attention.py then runs its kernel cases on the GPU too)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from helpers.engine import backend_engine, scheduled_seq
from helpers.hf_reference import NEW_TOKENS, hf_greedy, mixed_prompts
from helpers.paged_attention import check, check_split_invariance
from helpers.sampling import every_option_batch

from tachyllm import LLM, SamplingParams
from tachyllm.backends.registry import resolve_backend_name
from tachyllm.errors import ConfigError
from tachyllm.sampling.sampler import Sampler
from tachyllm.step import ScheduledSeq, StepBatch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", False), ("qwen3", True)])
def test_cuda_greedy_matches_transformers(tiny_model_factory, arch, tie, backend):
    import transformers

    path = tiny_model_factory(arch, tie)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to("cuda")
    llm = LLM(str(path), dtype="float32", device="cuda", block_size=4, kv_cache_memory=4 << 20,
              max_num_batched_tokens=64, backend=backend)  # fmt: skip
    assert llm.engine.backend.name == ("cuda" if backend == "auto" else "torch")  # auto: Triton on a GPU
    prompts = mixed_prompts(hf.config.vocab_size)
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False
    )
    for prompt, out in zip(prompts, outputs):
        assert out.error is None
        with torch.device("cuda"):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), (
                f"{arch}: prompt of {len(prompt)} tokens"
            )
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cuda_bf16_batch_is_invariant_and_samples(tiny_model_factory):
    """bf16 weights, chunked prefill, seeded sampling and n-gram speculation on the GPU: alone
    equals batched, seeds reproduce in any batch order, every block comes back."""
    path = str(tiny_model_factory("llama"))
    prompts = mixed_prompts(300, lengths=(5, 40, 9, 23), seed=1)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM(path, dtype="bfloat16", device="cuda", max_num_batched_tokens=16, kv_cache_memory=4 << 20,
              speculative_config=spec)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == 10 for t in together)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompts, seeded, use_tqdm=False)
    again = llm.generate(prompts[::-1], seeded, use_tqdm=False)[::-1]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cuda_fp8_kv_cache_runs(tiny_model_factory):
    """An fp8 cache on the GPU: complete, repeatable outputs and every block returned. (Not
    batch-invariant: a quantized cache runs the PyTorch attention path, whose bf16 rounding follows
    the padded batch shape; on the CPU too.)"""
    path = str(tiny_model_factory("llama"))
    prompts = mixed_prompts(300, lengths=(5, 40, 9, 23), seed=1)
    llm = LLM(
        path, dtype="bfloat16", device="cuda", kv_cache_dtype="fp8", max_num_batched_tokens=16, kv_cache_memory=4 << 20
    )
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 10 for t in runs[0])
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# -- Triton kernels and quantized weights (the kernels' own tests, tests/test_triton_*.py, run compiled on
# the GPU where there is one; these check what only the GPU has: fp8 GEMMs, whole engines on the kernels)
def _hopper() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="fp8 GEMMs need compute capability 9.0")
def test_cuda_fp8_linear_matches_its_fp32_reference():
    from tachyllm.quantization.fp8 import Fp8Linear, quantize_rows

    linear = torch.nn.Linear(256, 128, device="cuda")
    module = Fp8Linear.from_linear(linear)
    x = torch.randn(33, 256, device="cuda") * 2
    xq, x_scales = quantize_rows(x)
    scaled = (xq.float() * x_scales) @ module.dequantized().t() + linear.bias.detach()
    y = module(x)
    assert y.dtype == torch.float32
    # The fp8 products are exact; the GEMM writes bf16 (row-wise scaling on CUDA): 2^-8 of the output.
    assert (y - scaled).abs().max() <= 2**-7 * scaled.abs().max()
    assert (y - linear(x)).abs().max() <= 0.1 * linear(x).abs().max()
    assert module(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_cuda_quantized_engine_on_the_triton_kernels(tiny_model_factory, monkeypatch, method):
    """bf16 weights quantized and run on the Triton GEMMs (fp8: torch._scaled_mm) with the Triton
    elementwise ops: complete outputs, and (int4 / int8) each prompt alone equals the batch."""
    if method == "fp8" and not _hopper():
        pytest.skip("fp8 GEMMs need compute capability 9.0")
    from tachyllm.backends import registry
    from tachyllm.backends.torch_backend import TorchBackend
    from tachyllm.backends.triton_ops import TritonOps
    from tachyllm.kernels.triton import quant_matmul
    from tachyllm.quantization.int4 import Int4Linear
    from tachyllm.quantization.int8 import Int8Linear

    class TritonBackend(TorchBackend):
        def __init__(self, device: torch.device):
            super().__init__(device)
            self.ops = TritonOps()

        def quantized_matmul_kernels(self):
            return quant_matmul

    monkeypatch.setitem(registry._BACKENDS, "torch", TritonBackend)
    path = str(tiny_model_factory("llama"))
    llm = LLM(path, dtype="bfloat16", device="cuda", backend="torch", quantization=method, kv_cache_memory=4 << 20,
              max_num_batched_tokens=16)  # fmt: skip
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear | Int8Linear)]
    assert method == "fp8" or (len(layers) == 8 and all(getattr(m, "_matmul", None) is not None for m in layers))
    prompts = mixed_prompts(300, lengths=(5, 40, 9, 23), seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert all(len(t) == 10 for t in together)
    if method != "fp8":  # _scaled_mm picks its kernel by shape: not batch invariant
        assert together == [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("float16", "auto"), ("bfloat16", "fp8"),
                                                  ("bfloat16", "fp8_e5m2"), ("float32", "int8")])  # fmt: skip
def test_cuda_backend_computes_the_torch_backends_steps(tiny_model_factory, dtype, kv_cache_dtype):
    """The Triton kernels against the PyTorch path on the device: prefill chunks (a first one, then
    one on cached context), a decode with draft tokens next to a plain decode. fp32: every row's
    hidden state agrees; half types: the Triton path is as close to the fp32 model as the PyTorch
    path is (which rounds its scores to the half type)."""
    path = tiny_model_factory("llama")
    kw = dict(device="cuda", kv_cache_dtype=kv_cache_dtype)
    engines = [backend_engine(path, "torch", dtype=dtype, **kw), backend_engine(path, "cuda", dtype=dtype, **kw)]
    reference = backend_engine(path, "torch", dtype="float32", **kw)
    a, b = list(range(3, 23)), list(range(40, 70))  # 20 and 30 tokens
    ta, tb = list(range(0, 8)), list(range(8, 18))
    steps = [
        StepBatch([scheduled_seq(1, a, 0, 12, [], ta), scheduled_seq(2, b, 0, 10, [], tb)]),
        StepBatch([scheduled_seq(1, a, 12, 8, [], ta), scheduled_seq(2, b, 10, 20, [], tb)]),
        StepBatch([scheduled_seq(1, a + [5], 20, 1, [6, 7], ta), scheduled_seq(2, b + [9], 30, 1, [], tb)]),
    ]
    for batch in steps:
        plain, triton = (e.runner.forward(batch).float() for e in engines)
        if dtype == "float32":
            torch.testing.assert_close(triton, plain, rtol=1e-4, atol=1e-4)
            continue
        exact = reference.runner.forward(batch).float()
        error = [((x - exact).norm() / exact.norm()).item() for x in (plain, triton)]
        assert error[1] <= 1.25 * error[0] + 1e-3, error


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
def test_cuda_backend_cold_and_warm_prefix_cache_agree(tiny_model_factory, kv_cache_dtype):
    """fp32 weights on the cuda backend: a prompt computed cold (in chunks) and again on its cached
    prefix gives the same greedy tokens, an fp8 cache included (the kernel reads every chunk's K/V back
    from the quantized cache, so a cached prefix reads the same values)."""
    path = str(tiny_model_factory("llama"))
    prompts = mixed_prompts(300, lengths=(37, 52), seed=3)
    llm = LLM(path, dtype="float32", device="cuda", backend="cuda", kv_cache_dtype=kv_cache_dtype, block_size=4,
              max_num_batched_tokens=16, kv_cache_memory=4 << 20)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    hits = llm.engine.stats.prefix_cache_hits
    warm = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], greedy, use_tqdm=False)][::-1]
    assert llm.engine.stats.prefix_cache_hits > hits
    assert cold == warm


def test_cuda_backend_greedy_with_speculation_matches_torch_backend(tiny_model_factory):
    """Chunked prefill and n-gram speculation (verification steps): the same greedy tokens on both backends."""
    path = str(tiny_model_factory("llama"))
    prompts = mixed_prompts(300, lengths=(5, 40, 9, 23), seed=1)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = {}
    for backend in ("torch", "cuda"):
        llm = LLM(path, dtype="float32", device="cuda", backend=backend, max_num_batched_tokens=16,
                  kv_cache_memory=4 << 20, speculative_config=spec)  # fmt: skip
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert runs["cuda"] == runs["torch"]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype,cache_dtype,window",
    [
        (32, 8, 128, torch.bfloat16, None, None),  # Llama-3-8B's attention
        (9, 3, 64, torch.float16, torch.float8_e4m3fn, None),  # SmolLM2-135M's, on an fp8 cache
        (8, 4, 256, torch.bfloat16, torch.int8, 700),  # Gemma 3's local layers (window shrunk), int8
    ],
)
def test_triton_attention_on_the_device(heads, kv_heads, head_dim, dtype, cache_dtype, window):
    """The Triton kernel at real sizes on the GPU, against the fp64 reference: long decodes over several
    512-position segments (split-KV), a verification, a chunk after cached context; the split and the
    single-program paths give the same bits, and so does each sequence alone."""
    specs = [(2000, 1), (1100, 1), (5, 1), (1500, 4), (700, 90)]
    args, out = check(specs, block_size=16, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                      cache_dtype=cache_dtype, window=window)  # fmt: skip
    check_split_invariance(args, out, window, 512)


def _cuda_backend_or_skip() -> None:
    try:
        resolve_backend_name("cuda", torch.device("cuda"))
    except ConfigError as e:
        pytest.skip(f"the cuda backend: {e}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_greedy_matches_eager(tiny_model_factory, dtype):
    """Decode steps replayed from CUDA graphs (batches of 1, 3 and 9 sequences: buckets 1, 4 and 16,
    so padded) give the same greedy tokens as the same engine run eagerly (--enforce-eager)."""
    _cuda_backend_or_skip()
    path = str(tiny_model_factory("llama"))
    batches = [
        mixed_prompts(300, lengths=lengths, seed=2) for lengths in ((5,), (2, 40, 9), (3, 7, 1, 23, 6, 2, 9, 5, 4))
    ]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        llm = LLM(path, dtype=dtype, device="cuda", backend="cuda", max_num_seqs=16, kv_cache_memory=16 << 20,
                  enforce_eager=eager)  # fmt: skip
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        outputs[eager] = [[o.outputs[0].token_ids for o in llm.generate(p, greedy, use_tqdm=False)] for p in batches]
        if not eager:
            assert sorted(graphs.graphs) == [(b, 1) for b in (1, 2, 4, 8, 16)] and graphs.replays >= 3 * 11
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        del llm
    assert outputs[False] == outputs[True]


def test_cuda_graphs_verification_steps(tiny_model_factory):
    """n-gram speculation with k = 3 fixed: verification steps of 3 drafts get graphs of their own; the
    greedy tokens equal the eager engine's (steps with fewer drafts run eagerly)."""
    _cuda_backend_or_skip()
    path = str(tiny_model_factory("llama"))
    prompts = [[5 + i, 6 + i, 7 + i] * 6 for i in range(9)]  # repetitive: the n-gram proposer finds drafts
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", backend="cuda", max_num_seqs=16, kv_cache_memory=16 << 20,
                  enforce_eager=eager, speculative_config=spec)  # fmt: skip
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if not eager:
            assert (16, 4) in llm.engine.runner.graphs.graphs
        del llm
    assert outputs[False] == outputs[True]


def test_cuda_graph_replays_a_verification_step(tiny_model_factory):
    """A verification step of 3 sequences with k = 2 drafts each, replayed from the graph of batch size 4
    (padded): the hidden states and greedy tokens of the same step run eagerly, at every position."""
    _cuda_backend_or_skip()
    spec = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", device="cuda", backend="cuda", block_size=4,
              max_num_seqs=8, kv_cache_memory=8 << 20, speculative_config=spec)  # fmt: skip
    runner = llm.engine.runner
    prompts = mixed_prompts(250, lengths=(5, 9, 4), seed=4)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]  # block 0 holds the captures' K/V

    def seq(i: int, start: int, tokens: list[int], drafts: int) -> ScheduledSeq:
        return ScheduledSeq(
            seq_id=i, request_id=str(i), start=start, token_ids=tokens, num_draft_tokens=drafts,
            block_table=tables[i], seq_len=start + len(tokens) - drafts, completes=True,
        )  # fmt: skip

    runner.forward(StepBatch([seq(i, 0, p, 0) for i, p in enumerate(prompts)]))  # a prefill: eager
    step = StepBatch([seq(i, len(p), [7 + i, 8, 9 + i], 2) for i, p in enumerate(prompts)])
    graphs = runner.graphs
    assert graphs.bucket(step) == (4, 3)
    replayed = runner.forward(step).clone()
    assert graphs.replays == 1
    runner.graphs = None
    eager = runner.forward(step)
    runner.graphs = graphs
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():  # the runner's outputs are inference tensors
        logits = llm.engine.model.compute_logits
        assert torch.equal(logits(replayed).argmax(-1), logits(eager).argmax(-1))


def test_cuda_graph_memory_is_reserved_before_the_kv_cache(tiny_model_factory, caplog):
    """Without --kv-cache-memory the cache is sized after the graphs' memory is measured; capture is logged."""
    _cuda_backend_or_skip()
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16", device="cuda", backend="cuda", max_num_seqs=8,
                  gpu_memory_utilization=0.3)  # fmt: skip
    assert "CUDA graphs: a trial capture of 1 (batch sizes [8]" in caplog.text  # measured before the KV cache
    assert "CUDA graphs: 4 (batch sizes [1, 2, 4, 8] x queries per sequence [1]) captured" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("logprobs", [False, True])
def test_cuda_sampler_syncs_once_per_step(logprobs):
    """torch.cuda's sync debug mode warns at every call that waits for the device: a step's sampling
    with every option (seeded rows on their own device generators) waits once for the sampled ids,
    and once more for logprobs when a row asks for them."""
    rows = [r for r in every_option_batch() if logprobs or r.params.logprobs is None]
    for r in rows:
        if r.generator is not None:
            r.generator = torch.Generator(device="cuda").manual_seed(r.params.seed)
    sampler = Sampler(20, eos_token_ids=[19], device=torch.device("cuda"), seed=3)
    logits = torch.randn(len(rows), 20, device="cuda")
    sampler(logits, rows)  # lazy initialisation (pinned memory, kernels) outside the count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1 + logprobs, syncs  # where each sync was called from
