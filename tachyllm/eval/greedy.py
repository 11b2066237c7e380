"""Greedy generation and position-wise agreement, for comparing a configuration with a reference."""

from __future__ import annotations

from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.outputs import RequestOutput
from tachyllm.sampling_params import RequestOutputKind, SamplingParams


def greedy_tokens(engine: LLMEngine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"greedy-{i}", prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and isinstance(out, RequestOutput):
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"greedy-{i}"] for i in range(len(prompts))]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Share of generated positions holding the reference's token. Strict: after a divergence the
    continuations differ, so every later position counts as a disagreement."""
    same = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref))
    return same / sum(map(len, reference))
