"""Pooling: a sequence's final hidden states -> one vector (docs/pooling.md).

MEAN averages every token's hidden state, CLS takes the first token's, LAST the last one's. A causal
model's prompt may be prefilled in chunks: `PoolingState` carries what a chunk leaves for the next
(the running fp32 sum and the token count, or the first row). An embedding is then cut to its first
`dimensions` values (Matryoshka) and L2-normalised; a classifier's logits become probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tachyllm.step import PoolingInput

POOLING_TYPES = ("MEAN", "CLS", "LAST")


@dataclass(eq=False)
class PoolingState:
    """What a pooling sequence's chunks so far contribute: the fp32 sum of their rows (MEAN) and how many,
    or the first row (CLS)."""

    total: torch.Tensor | None = None
    count: int = 0


def pool_chunk(rows: torch.Tensor, pooling_type: str, state: PoolingState, last: bool) -> torch.Tensor | None:
    """Adds one chunk's hidden rows [tokens, hidden] (the sequence's first chunk on a fresh state) to
    `state`; with `last` (the chunk completes the sequence) returns the pooled fp32 vector [hidden]."""
    if pooling_type == "MEAN":
        chunk_sum = rows.float().sum(0)
        state.total = chunk_sum if state.total is None else state.total + chunk_sum
        state.count += rows.shape[0]
        return state.total / state.count if last else None
    if pooling_type == "CLS":
        if state.total is None:
            state.total = rows[0].float()
        return state.total if last else None
    if pooling_type == "LAST":
        return rows[-1].float() if last else None
    raise ValueError(f"unknown pooling type {pooling_type!r}; known: {', '.join(POOLING_TYPES)}")


def finish_embedding(pooled: torch.Tensor, pooling: PoolingInput) -> torch.Tensor:
    """An embedding as a request asked for it: cut to its first `dimensions` values, then L2-normalised."""
    if pooling.dimensions is not None:
        pooled = pooled[..., : pooling.dimensions]
    if pooling.normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled


def class_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A classification head's logits as probabilities: the sigmoid of a single label's logit (a
    cross-encoder's relevance score), else the softmax over the labels."""
    logits = logits.float()
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
