"""An online model of a step's wall time, for decode-latency-aware chunked prefill.

A step costs about  fixed + per_token * tokens + per_pair * attention_pairs,  where `tokens` is the
batch's token count (the linears) and `attention_pairs` counts (query, visible key) pairs: a chunk
of C tokens starting at position s attends over C*s + C*(C+1)/2 of them, a decode over its context.
The coefficients are refitted by least squares over the most recent steps, so they follow the
machine (threads, kernels, load) instead of being set by hand. The scheduler uses the prediction to
cut prefill chunks so that a step carrying one stays within `max_decode_slowdown` times the step
the running decodes would take alone (the idea of Sarathi-Serve's stall-free batching, with the
budget measured rather than profiled offline).
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 256  # steps the fit looks back over
MIN_STEPS = 8  # no prediction before this many steps of at least two different shapes


def attention_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs of num_tokens causal queries at positions start .. start + num_tokens - 1."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    def __init__(self) -> None:
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._coefficients: np.ndarray | None = None

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        self._steps.append((float(tokens), float(pairs), seconds))
        self._coefficients = None

    def coefficients(self) -> np.ndarray | None:
        """(fixed, per_token, per_pair) in seconds, all >= 0; None until the steps vary enough."""
        if self._coefficients is None and len(self._steps) >= MIN_STEPS:
            data = np.array(self._steps)
            if len({(t, p) for t, p, _ in self._steps}) >= 2:
                self._coefficients = _nonnegative_fit(data[:, :2], data[:, 2])
        return self._coefficients

    def predict(self, tokens: int, pairs: int) -> float | None:
        c = self.coefficients()
        return None if c is None else float(c[0] + c[1] * tokens + c[2] * pairs)


def _nonnegative_fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative one (from noise or too little
    variety) is pinned to 0 and the rest refitted."""
    scale = features.max(axis=0).clip(min=1.0)  # the pair counts are ~1e6x the token counts
    x = np.column_stack([np.ones(len(features)), features / scale])
    active = [0, 1, 2]
    while True:
        solution = np.zeros(3)
        solution[active] = np.linalg.lstsq(x[:, active], seconds, rcond=None)[0]
        negative = [i for i in active if solution[i] < 0]
        if not negative:
            return solution / np.concatenate([[1.0], scale])
        active.remove(min(negative, key=lambda i: solution[i]))
