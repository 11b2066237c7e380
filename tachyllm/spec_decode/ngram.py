"""N-gram prompt lookup: if the sequence's last n tokens occurred before in its prompt or output,
propose the tokens that followed that occurrence. Free to compute, and right surprisingly often
when the answer quotes its input (code edits, summaries, extraction)."""

from __future__ import annotations

import numpy as np

from tachyllm.core.sequence import Sequence
from tachyllm.spec_decode.proposer import Draft, Proposer


class NgramProposer(Proposer):
    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(self.lookup(seq, k)) for seq, k in zip(seqs, ks)]

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching
        suffix (lookup_max tokens down to lookup_min); [] when there is none."""
        tokens = np.asarray(seq.token_ids, dtype=np.int64)
        total = len(tokens)
        # Where an earlier token equals the last one, with at least one token after it: the only
        # places a suffix match can end. Longer suffixes are checked there alone, one token back
        # at a time, which keeps a lookup at a few numpy ops whatever the context length.
        ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])
        matched = np.ones(len(ends), dtype=bool)
        best = None
        for n in range(1, min(self.lookup_max, total - 1) + 1):
            if n > 1:
                back = ends - (n - 1)
                matched &= back >= 0
                matched[matched] = tokens[back[matched]] == tokens[total - n]
            if not matched.any():
                break
            if n >= self.lookup_min:
                best = int(ends[matched][-1])
        if best is None:
            return []
        return tokens[best + 1 : best + 1 + k].tolist()
