"""Speculative decoding configurations and an oracle proposer that drafts from a reference run's output."""

from __future__ import annotations

import random

from tachyllm import LLM
from tachyllm.core.sequence import Sequence

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}


def draft(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "adaptive": False}


def oracle_drafts(llm: LLM, references: dict[tuple[int, ...], list[int]], error_rate: float = 0.3) -> None:
    """Replaces n-gram lookup by proposals from a reference run's output, each token corrupted with
    probability error_rate: random tiny models rarely repeat their prompt, and this exercises
    acceptance, partial rejection and rollback at every position."""
    rng = random.Random(5)

    def propose(seq: Sequence, k: int) -> list[int]:
        reference = references[tuple(seq.token_ids[: seq.num_prompt_tokens])]
        upcoming = reference[seq.num_output_tokens : seq.num_output_tokens + k]
        return [t if rng.random() > error_rate else (t + 1) % 300 for t in upcoming]

    llm.engine.speculator.proposer.lookup = propose


def with_oracle(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> LLM:
    oracle_drafts(llm, {tuple(p): e for p, e in zip(prompts, expected)})
    return llm


# Suffix decoding forced on (adaptive off), with a shallow tree so tiny models' short outputs match.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 12, "adaptive": False}
