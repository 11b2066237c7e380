"""The engine on a CUDA device: the portable PyTorch path (the C++ kernels are CPU-only), and the
cuda backend's CUDA graphs (skipped while that backend is unavailable) and host-sync-free sampling.
Skipped where no GPU is present, as in CI; run on a GPU machine with `pytest tests/test_cuda.py`
(benchmarks/gpu_check.sh does)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from test_hf_parity import NEW_TOKENS, hf_greedy, mixed_prompts
from test_sampler import _every_option_batch

from tachyllm import LLM, SamplingParams
from tachyllm.backends.registry import resolve_backend_name
from tachyllm.errors import ConfigError
from tachyllm.sampling.sampler import Sampler
from tachyllm.step import ScheduledSeq, StepBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", False), ("qwen3", True)])
def test_cuda_greedy_matches_transformers(tiny_model_factory, arch, tie):
    import transformers

    path = tiny_model_factory(arch, tie)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to("cuda")
    llm = LLM(
        str(path), dtype="float32", device="cuda", block_size=4, kv_cache_memory=4 << 20, max_num_batched_tokens=64
    )
    assert llm.engine.backend.name == "torch"  # auto: the C++ kernels are CPU-only
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
    rows = [r for r in _every_option_batch() if logprobs or r.params.logprobs is None]
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
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1 + logprobs, syncs
