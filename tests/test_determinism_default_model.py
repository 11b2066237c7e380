"""The default model's outputs, token for token, do not depend on the prefix cache, prompt chunking or
the batch (docs/determinism.md): float32 as it is, bf16 with the deterministic mode."""

from __future__ import annotations

import pytest

from tachyllm import LLM, SamplingParams
from tachyllm.kernels import native

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(native.native_ops() is None, reason="the guarantee is the C++ kernels'"),
]

# Chat prompts well past 48 tokens (the template's system prompt included): their prefill runs the
# large-step path, and the second asking finds all but the last block cached.
QUESTIONS = [
    "Summarise in two sentences why the sky looks blue during the day but red at sunset, for a child.",
    "Write a short Python function that returns the n-th Fibonacci number, then explain its complexity.",
    "List three things to check before a long bicycle ride in the mountains, and say why each matters.",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=16),
    SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=16),
]


def _texts(llm: LLM, conversations, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.chat(conversations, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype, deterministic", [("float32", False), ("bfloat16", True)])
def test_default_model_is_deterministic(default_model_path, dtype, deterministic):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    llm = LLM(default_model_path, dtype=dtype, deterministic=deterministic)
    chunked = LLM(
        default_model_path, dtype=dtype, deterministic=deterministic, max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )  # fmt: skip
    for params in PARAMS:
        cold = [_texts(llm, [c], params)[0] for c in conversations]
        warm = [_texts(llm, [c], params)[0] for c in conversations]
        assert warm == cold, f"cold vs warm prefix cache ({params.temperature=})"
        assert _texts(llm, conversations * 4, params) == cold * 4, "alone vs a batch of 12"
        assert [_texts(chunked, [c], params)[0] for c in conversations] == cold, "chunks of 32 tokens"
    assert llm.engine.stats.prefix_cache_hits > 0
