"""N-gram prompt lookup: if the sequence's last n tokens occurred before in its prompt or output,
propose the tokens that followed that occurrence. Free to compute, and right surprisingly often
when the answer quotes its input (code edits, summaries, extraction)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tachyllm.engine.sequence import Sequence


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching
        suffix (lookup_max tokens down to lookup_min); [] when there is none."""
        tokens = np.asarray(seq.token_ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(self.lookup_max, total - 1), self.lookup_min - 1, -1):
            # Windows starting before total - n: the suffix itself is excluded, and a match leaves at
            # least one following token to propose.
            windows = sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
