"""Sampler input rows without an engine behind them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tachyllm import SamplingParams


def row(params: SamplingParams, prompt=(1,), output=(), seed=None):
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    ids = list(prompt) + list(output)
    return SimpleNamespace(
        params=params,
        token_ids=ids,
        output_token_ids=list(output),
        num_output_tokens=len(output),
        generator=gen,
        allowed_tokens=None,
    )


def every_option_batch() -> list[SimpleNamespace]:
    """36 rows cycling through every sampling option, every third row seeded."""
    options = [
        dict(temperature=0), dict(temperature=0.8), dict(temperature=1.2, top_k=5), dict(top_p=0.7),
        dict(min_p=0.1, temperature=0.9), dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.02),
        dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, temperature=0.6),
        dict(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0),
        dict(temperature=0.5, logit_bias={3: 2.0, 7: -1.5}), dict(temperature=0.9, min_tokens=5, stop_token_ids=[4]),
        dict(temperature=0, logprobs=3), dict(temperature=1.0, logprobs=0),
    ]  # fmt: skip
    rows = []
    for i in range(36):
        seed = 100 + i if i % 3 == 0 else None
        output = [i % 7, (3 * i) % 20, 5][: i % 4]
        params = SamplingParams(seed=seed, **options[i % len(options)])
        rows.append(row(params, prompt=[1, 2, 3, i % 20], output=output, seed=seed))
    return rows
