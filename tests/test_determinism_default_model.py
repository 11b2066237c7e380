"""The default model's outputs, token for token, do not depend on the prefix cache, prompt chunking, the
batch, preemption or speculation (docs/determinism.md): float32 as it is, bf16 in the deterministic
mode (the default)."""

from __future__ import annotations

import pytest

from tachyllm import LLM, SamplingParams
from tachyllm.kernels.native import native_ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.native,  # the guarantee is the C++ kernels'
]

# Chat prompts well past 48 tokens (the template's system prompt included): their prefill runs the
# large-step path, and the second asking finds all but the last block cached.
QUESTIONS = [
    "Summarise in two sentences why the sky looks blue during the day but red at sunset, for a child.",
    "Write a short Python function that returns the n-th Fibonacci number, then explain its complexity.",
    "List three things to check before a long bicycle ride in the mountains, and say why each matters.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=16)
# A KV cache for about 1,000 tokens: a batch of 33 such prompts (not sharing their blocks) is preempted.
SMALL_CACHE = {"float32": 48 << 20, "bfloat16": 24 << 20}


def _tokens(llm: LLM, conversations, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.chat(conversations, params, use_tqdm=False)]


def _alone(llm: LLM, conversations, params) -> list[list[int]]:
    return [_tokens(llm, [c], params)[0] for c in conversations]


@pytest.mark.parametrize("dtype, deterministic", [("float32", False), ("bfloat16", True)])
def test_default_model_is_deterministic(default_model_path, dtype, deterministic):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    options = {"dtype": dtype, "deterministic": deterministic}
    llm = LLM(default_model_path, **options)
    for params in (GREEDY, SEEDED):
        cold = _alone(llm, conversations, params)
        assert _alone(llm, conversations, params) == cold, f"cold vs warm prefix cache ({params.temperature=})"
        assert _tokens(llm, conversations * 11, params) == cold * 11, "alone vs a batch of 33"
        for budget in (16, 64):
            chunked = LLM(default_model_path, max_num_batched_tokens=budget, enable_prefix_caching=False, **options)
            assert _alone(chunked, conversations, params) == cold, f"chunks of {budget} tokens"
            del chunked
        small = LLM(default_model_path, kv_cache_memory=SMALL_CACHE[dtype], enable_prefix_caching=False, **options)
        assert _tokens(small, conversations * 11, params) == cold * 11, "preempted"
        assert small.engine.stats.num_preemptions > 0
        del small
    assert llm.engine.stats.prefix_cache_hits > 0
    del llm
    plain = LLM(default_model_path, enable_prefix_caching=False, **options)
    expected = _alone(plain, conversations, GREEDY)
    # Suffix decoding's trees are C++: without the kernels the engine refuses it (tested elsewhere).
    for method in ("ngram", "suffix") if native_ops() is not None else ("ngram",):
        spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
        speculating = LLM(default_model_path, speculative_config=spec, **options)
        assert _alone(speculating, conversations, GREEDY) == expected, method
        assert speculating.engine.stats.spec_num_accepted_tokens > 0, method  # drafts were verified
        del speculating
