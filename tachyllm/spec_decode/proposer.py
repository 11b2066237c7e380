"""The interface every draft-token proposer implements (n-gram lookup, a draft model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tachyllm.core.sequence import Sequence


@dataclass
class Draft:
    token_ids: list[int]
    # The distribution each token was drawn from ([len, vocab]) when it was sampled, for the
    # rejection test; None for a deterministic proposal (greedy, or a lookup).
    probs: torch.Tensor | None = None


class Proposer(ABC):
    # Whether proposing runs forwards (a draft model): the adaptive switch then weighs their cost and
    # proposals are made only after it chose how many tokens. Free proposers (lookups) propose for
    # every candidate first, so that only sequences with drafts count as speculating.
    runs_forwards: bool = False

    @abstractmethod
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] draft tokens to follow seqs[i] (fewer, or none, when there is nothing to propose)."""

    def lag(self, seq: Sequence) -> int:
        """Tokens of seq the proposer must catch up on before it can propose for it."""
        return 0

    def release_finished(self, running: list[Sequence]) -> None:
        """Drops state kept for sequences no longer running."""

    @property
    def forward_costs(self) -> list[tuple[int, float]]:
        """(tokens, seconds) of each forward the last propose() ran."""
        return []
