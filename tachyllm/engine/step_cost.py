"""An online model of a step's wall time, for decode-latency-aware chunked prefill.

A step costs about  fixed + per_token * tokens + per_pair * attention_pairs + per_read * context,
where `tokens` is the batch's token count (the linears), `attention_pairs` counts (query, visible
key) pairs (attention's arithmetic: a chunk of C tokens starting at position s attends over
C*s + C*(C+1)/2 of them, a decode over its context) and `context` counts the positions whose K/V
attention reads (its memory traffic, once per sequence however many queries it has: a few-token
chunk of a long prompt costs at least its whole context). The coefficients are refitted by
least squares over the most recent steps, so they follow the machine (threads, kernels, load)
instead of being set by hand. The scheduler uses the prediction to cut prefill chunks so that a
step carrying one stays within `max_decode_slowdown` times the step the running decodes would
take alone (the idea of Sarathi-Serve's stall-free batching, with the budget measured rather than
profiled offline).
"""

from __future__ import annotations

from collections import deque
from dataclasses import astuple, dataclass

import numpy as np

WINDOW = 128  # steps the fit looks back over, of each kind (one token per sequence, or not)
MIN_STEPS = 8  # no prediction before this many steps of at least two different shapes
BIAS_WEIGHT = 0.1  # of the latest step in the running measured / fitted ratio of its kind
MAX_BIAS = 3.0  # one step's ratio counts at most this much (a stall must not blow up the cap)


def attention_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs of num_tokens causal queries at positions start .. start + num_tokens - 1."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on (module docstring)."""

    tokens: int = 0
    pairs: int = 0
    context: int = 0

    @staticmethod
    def of(start: int, num_tokens: int) -> StepShape:
        """One sequence computing num_tokens tokens from position `start`."""
        return StepShape(num_tokens, attention_pairs(start, num_tokens), start + num_tokens)

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(self.tokens + other.tokens, self.pairs + other.pairs, self.context + other.context)


class StepCostModel:
    def __init__(self) -> None:
        # Steps where every sequence computed one token (pairs == context), and the others. Both
        # stay in the fit: during a long prefill every step carries a chunk, and a window of those
        # alone would leave the decodes-only prediction, the cap's yardstick, extrapolated.
        self._decode_steps: deque[tuple[StepShape, float]] = deque(maxlen=WINDOW)
        self._other_steps: deque[tuple[StepShape, float]] = deque(maxlen=WINDOW)
        self._coefficients: np.ndarray | None = None
        # Recent measured / fitted time of each kind: one linear fit over both kinds can be biased
        # for one of them (the kernels' costs are not exactly linear), and the machine drifts.
        self._bias = {True: 1.0, False: 1.0}

    def observe(self, shape: StepShape, seconds: float) -> None:
        decode_only = shape.pairs == shape.context
        fitted = self._fitted(shape)
        if fitted is not None and fitted > 0:
            self._bias[decode_only] += BIAS_WEIGHT * (min(seconds / fitted, MAX_BIAS) - self._bias[decode_only])
        (self._decode_steps if decode_only else self._other_steps).append((shape, seconds))
        self._coefficients = None

    def coefficients(self) -> np.ndarray | None:
        """(fixed, per_token, per_pair, per_read) in seconds, all >= 0; None until the steps vary enough."""
        steps = [*self._decode_steps, *self._other_steps]
        if self._coefficients is None and len(steps) >= MIN_STEPS and len({shape for shape, _ in steps}) >= 2:
            features = np.array([astuple(shape) for shape, _ in steps], dtype=float)
            self._coefficients = _nonnegative_fit(features, np.array([s for _, s in steps]))
        return self._coefficients

    def predict(self, shape: StepShape) -> float | None:
        fitted = self._fitted(shape)
        return None if fitted is None else fitted * self._bias[shape.pairs == shape.context]

    def _fitted(self, shape: StepShape) -> float | None:
        c = self.coefficients()
        return None if c is None else float(c[0] + np.dot(c[1:], astuple(shape)))


def _nonnegative_fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative one (from noise or too little
    variety) is pinned to 0 and the rest refitted. Collinear terms (decode-only steps read as
    many positions as they have pairs) share the cost; predictions stay right for such steps."""
    scale = features.max(axis=0).clip(min=1.0)  # the pair counts are ~1e6x the token counts
    x = np.column_stack([np.ones(len(features)), features / scale])
    active = list(range(x.shape[1]))
    while True:
        solution = np.zeros(x.shape[1])
        solution[active] = np.linalg.lstsq(x[:, active], seconds, rcond=None)[0]
        negative = [i for i in active if solution[i] < 0]
        if not negative:
            return solution / np.concatenate([[1.0], scale])
        active.remove(min(negative, key=lambda i: solution[i]))
