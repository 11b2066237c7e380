"""Greedy output must equal Hugging Face transformers token for token (fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import NEW_TOKENS, hf_greedy, mixed_prompts

from tachyllm import LLM, SamplingParams


@pytest.mark.parametrize(
    "arch,tie",
    [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False), ("qwen3", False), ("qwen3", True)],
)
def test_greedy_matches_transformers(tiny_model_factory, arch, tie):
    import transformers

    path = tiny_model_factory(arch, tie)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_num_batched_tokens=64)
    prompts = mixed_prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    # The whole batch must have returned every KV block.
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_batch_invariance_and_chunking(tiny_model_factory):
    """A prompt's greedy output is the same alone, in a mixed batch, and with tiny prefill chunks."""
    path = tiny_model_factory("llama")
    prompts = mixed_prompts(300, lengths=(5, 40, 9, 23, 2, 31), seed=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batched = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=4 << 20)
    together = [o.outputs[0].token_ids for o in batched.generate(prompts, params, use_tqdm=False)]
    alone = [batched.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    chunked = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params, use_tqdm=False)] == together
    unchunked = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory=4 << 20, enable_chunked_prefill=False,
                    enable_prefix_caching=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in unchunked.generate(prompts, params, use_tqdm=False)] == together


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_path):
    """The real SmolLM2 GGUF in fp32 against transformers loading the same file. A divergence is
    only accepted at a genuine near-tie of the reference's top two logits."""
    import os

    import transformers

    directory, filename = os.path.split(default_model_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32).eval()
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20)
    tok = llm.get_tokenizer()
    questions = [
        "What is the capital of France?",
        "Write a Python function that reverses a string.",
        "List three colors of the rainbow.",
        "Explain gravity in one sentence.",
    ]
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ours = out.outputs[0].token_ids
        ref = hf_greedy(hf, prompt, len(ours))
        for i, (a, b) in enumerate(zip(ours, ref)):
            if a != b:
                with torch.no_grad():
                    logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
                top2 = logits.topk(2).values
                margin = (top2[0] - top2[1]).item()
                assert margin < 0.1, f"diverged at token {i} ({a} vs {b}) with reference top-2 margin {margin:.4f}"
                break
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # fmt: skip
    assert answer[0].outputs[0].text.startswith("The capital of France is Paris")
