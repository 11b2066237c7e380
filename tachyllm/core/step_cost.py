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

The same measurements also fill a per-size table (CostBySize), which the speculative-decoding
switch reads: one model, fed once per step, for both.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import astuple, dataclass, field

import numpy as np

WINDOW = 128  # steps the fit looks back over, of each kind (one token per sequence, or not)
MIN_STEPS = 8  # no prediction before this many steps of at least two different shapes
BIAS_WEIGHT = 0.1  # of the latest step in the running measured / fitted ratio of its kind
MAX_BIAS = 3.0  # one step's ratio counts at most this much (a stall must not blow up the cap)
COST_EMA = 0.2  # weight of a new measurement in its size bucket


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


def _bucket(n: int) -> int:
    """Exact up to 16 tokens, then four buckets per doubling."""
    return n if n <= 16 else 16 + round(4 * math.log2(n / 16))


@dataclass
class CostBySize:
    """Seconds of a forward as a function of its size in tokens alone, from measurements: a table
    rather than a fit, since the CPU kernels make the cost far from linear in the token count
    (fused one-call layers up to a row threshold, batched matmuls beyond)."""

    points: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (mean size, seconds)

    def record(self, size: int, seconds: float) -> None:
        b = _bucket(size)
        old = self.points.get(b)
        self.points[b] = (size, seconds) if old is None else (
            old[0] + COST_EMA * (size - old[0]), old[1] + COST_EMA * (seconds - old[1])
        )  # fmt: skip

    def measured_up_to(self, size: int) -> bool:
        return any(p[0] <= size for p in self.points.values())

    def estimate(self, size: int, high: bool) -> float | None:
        """Seconds for a step of `size`: measured, or interpolated between the nearest measured sizes.
        Outside the measured range the estimate leans the cautious way: high=True gives an upper
        bound (cost grows at most linearly past the largest size, and a smaller step costs at most
        what the smallest measured did), high=False a lower bound. None before any measurement."""
        if not self.points:
            return None
        exact = self.points.get(_bucket(size))
        if exact is not None:
            return exact[1]
        below = max((p for p in self.points.values() if p[0] <= size), default=None)
        above = min((p for p in self.points.values() if p[0] >= size), default=None)
        if below is None:
            assert above is not None, "self.points is not empty"
            return above[1] if high else above[1] * size / above[0]
        if above is None:
            return below[1] * size / below[0] if high else below[1]
        if above[0] == below[0]:
            return below[1]
        return below[1] + (above[1] - below[1]) * (size - below[0]) / (above[0] - below[0])


class StepCostModel:
    def __init__(self, linear_fit: bool = True) -> None:
        # The linear fit costs a least-squares solve per step; the scheduler only wants it for
        # max_decode_slowdown. The per-size table is always kept.
        self.linear_fit = linear_fit
        self.by_size = CostBySize()
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
        self.by_size.record(shape.tokens, seconds)
        if not self.linear_fit:
            return
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
            unscaled: np.ndarray = solution / np.concatenate([[1.0], scale])
            return unscaled
        active.remove(min(negative, key=lambda i: solution[i]))
