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

The same measurements also fill two per-size tables (CostBySize), which the speculative-decoding
switch reads: one of the steps without draft tokens and one of the steps that verify drafts. A
verification costs more than a plain step of the same token count (the LM head and the sampler
run over every draft position, not only each sequence's last; docs/design_measurements.md#speculative-step-cost),
so a switch judging drafts by plain steps' costs lets them through where they do not pay. One
model, fed once per step, for both.
"""

from __future__ import annotations

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


def _buckets(sizes: np.ndarray) -> np.ndarray:
    """Exact up to 16 tokens, then four buckets per doubling."""
    return np.where(sizes <= 16, sizes, 16 + np.rint(4 * np.log2(np.maximum(sizes, 16) / 16))).astype(np.int64)


def _empty(dtype: type) -> np.ndarray:
    return np.zeros(0, dtype)


@dataclass
class CostBySize:
    """Seconds of a forward as a function of its size in tokens alone, from measurements: a table
    rather than a fit, since the CPU kernels make the cost far from linear in the token count
    (fused one-call layers up to a row threshold, batched matmuls beyond).

    One point per size bucket, kept as arrays in bucket order, updated in place: the switch reads
    the table several times a step, and rebuilding it from a dict each time cost Python calls in
    proportion to the buckets measured. Bucket order is also the order of the points' mean sizes,
    since a bucket's mean stays within its range and the ranges do not overlap."""

    buckets: np.ndarray = field(default_factory=lambda: _empty(np.int64))
    sizes: np.ndarray = field(default_factory=lambda: _empty(np.float64))  # mean size measured per bucket
    seconds: np.ndarray = field(default_factory=lambda: _empty(np.float64))

    def __len__(self) -> int:
        return len(self.buckets)

    def record(self, size: int, seconds: float) -> None:
        b = int(_buckets(np.array(size)))
        i = int(self.buckets.searchsorted(b))
        if i < len(self.buckets) and self.buckets[i] == b:
            self.sizes[i] += COST_EMA * (size - self.sizes[i])
            self.seconds[i] += COST_EMA * (seconds - self.seconds[i])
        else:
            self.buckets = np.insert(self.buckets, i, b)
            self.sizes = np.insert(self.sizes, i, size)
            self.seconds = np.insert(self.seconds, i, seconds)

    def measured_up_to(self, size: int) -> bool:
        return len(self) > 0 and bool(self.sizes[0] <= size)

    def estimate(self, size: int, high: bool) -> float | None:
        """Seconds for a step of `size`: measured, or interpolated between the nearest measured sizes.
        Outside the measured range the estimate leans the cautious way: high=True gives an upper
        bound (cost grows at most linearly past the largest size, and a smaller step costs at most
        what the smallest measured did), high=False a lower bound. None before any measurement."""
        found = self.estimates(np.array([size]), high)
        return None if found is None else float(found[0])

    def estimates(self, sizes: np.ndarray, high: bool) -> np.ndarray | None:
        """estimate() of every size at once (any shape): the speculation switch weighs every draft
        length for several numbers of drafting sequences each step, which one size at a time in
        Python took milliseconds (docs/design_measurements.md#adaptive-switch-cost)."""
        if not len(self):
            return None
        xs, ys = self.sizes, self.seconds
        sizes = np.asarray(sizes)
        # Interpolated between the nearest measured sizes on either side ...
        # (ndarray methods and ufuncs throughout: numpy's function wrappers cost more calls than the work.)
        below = xs.searchsorted(sizes, side="right") - 1
        above = xs.searchsorted(sizes, side="left")
        lo, hi = np.maximum(below, 0), np.minimum(above, len(xs) - 1)
        span = xs[hi] - xs[lo]
        rise = (ys[hi] - ys[lo]) * (sizes - xs[lo])
        out = ys[lo] + np.divide(rise, span, out=np.zeros(rise.shape), where=span > 0)
        # ... or bounded outside the measured range.
        smaller = below < 0
        larger = above >= len(xs)
        out = np.where(smaller, ys[0] if high else ys[0] * sizes / xs[0], out)
        out = np.where(larger, ys[-1] * sizes / xs[-1] if high else ys[-1], out)
        # A size whose bucket was measured takes that bucket's time.
        b = _buckets(sizes)
        at = np.minimum(self.buckets.searchsorted(b), len(xs) - 1)
        result: np.ndarray = np.where(self.buckets[at] == b, ys[at], out)
        return result


class StepCostModel:
    def __init__(self, linear_fit: bool = True) -> None:
        # The linear fit costs a least-squares solve per step; the scheduler only wants it for
        # max_decode_slowdown. The per-size table is always kept.
        self.linear_fit = linear_fit
        self.by_size = CostBySize()  # steps without draft tokens
        self.spec_by_size = CostBySize()  # steps verifying draft tokens
        # Steps where every sequence computed one token (pairs == context), and the others. Both
        # stay in the fit: during a long prefill every step carries a chunk, and a window of those
        # alone would leave the decodes-only prediction, the cap's yardstick, extrapolated.
        self._decode_steps: deque[tuple[StepShape, float]] = deque(maxlen=WINDOW)
        self._other_steps: deque[tuple[StepShape, float]] = deque(maxlen=WINDOW)
        self._coefficients: np.ndarray | None = None
        # Recent measured / fitted time of each kind: one linear fit over both kinds can be biased
        # for one of them (the kernels' costs are not exactly linear), and the machine drifts.
        self._bias = {True: 1.0, False: 1.0}

    def observe(self, shape: StepShape, seconds: float, speculative: bool = False) -> None:
        """A step of `shape` took `seconds`; `speculative`: it verified draft tokens."""
        (self.spec_by_size if speculative else self.by_size).record(shape.tokens, seconds)
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

    def speculative_estimates(self, sizes: np.ndarray) -> np.ndarray | None:
        """Upper bounds on the seconds of steps of `sizes` tokens that verify drafts: from the
        verifying steps measured, or, before the first, from the plain steps. Outside the sizes of
        the verifications measured, a plain step's cost times what the nearest measured
        verification cost over a plain step of its size (at least 1x; above them, no more than the
        table's linear bound): the table's own bounds alone priced a batch of one like the batch
        of 32 its verifications were seen at, and held long drafts at a batch of one to the few
        tokens the first verifications had (docs/design_measurements.md#speculative-step-cost)."""
        measured = self.spec_by_size
        if not len(measured):
            return self.by_size.estimates(sizes, high=True)
        sizes = np.asarray(sizes)
        ends = measured.sizes[[0, -1]]
        # One lookup for the sizes asked and the ends.
        plain_all = self.by_size.estimates(np.concatenate([sizes.ravel(), ends]), high=True)
        spec = self.spec_by_size.estimates(sizes, high=True)
        if plain_all is None or spec is None:
            return None
        plain, plain_at_ends = plain_all[:-2].reshape(sizes.shape), plain_all[-2:]
        below, above = np.maximum(measured.seconds[[0, -1]] / plain_at_ends, 1.0).tolist()
        estimates: np.ndarray = np.where(
            sizes < ends[0], plain * below, np.where(sizes > ends[1], np.minimum(spec, plain * above), spec)
        )
        return estimates

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
