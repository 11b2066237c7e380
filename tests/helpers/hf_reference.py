"""The reference the engine's greedy output is held to: Hugging Face transformers' argmax loop, and
prompts of mixed lengths."""

from __future__ import annotations

import random

import torch

NEW_TOKENS = 12


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain argmax loop (no EOS handling) so that it matches ignore_eos=True exactly."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def mixed_prompts(vocab: int, lengths=(1, 3, 7, 16, 17, 33, 50), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
