"""The engine on a CUDA device, where every layer runs its plain PyTorch path (the C++ kernels are
CPU-only). Skipped where no GPU is present, as in CI; run on a GPU machine with
`pytest tests/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch
from test_hf_parity import NEW_TOKENS, hf_greedy, mixed_prompts

from tachyllm import LLM, SamplingParams

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
