"""When does speculation pay? Decide per step from measured costs and acceptance.

Verifying k draft tokens for B sequences makes the target's forward B * k tokens wider, plus the
proposer's own time (a draft model runs k small steps; n-gram lookup is nearly free). It gains,
per speculating sequence, the expected number of tokens emitted: 1 + sum_{i=1..k} prod_{j<=i} a_j,
where a_j is the measured probability that draft position j is accepted given j-1 were. The
controller picks the k in 0..max_k with the best expected tokens per second. On a CPU at batch 1 a
forward over a few more tokens costs almost nothing (the weights are read once either way), so k
is high; at large batches the forward is compute bound and k falls to 0.

Step costs come from the engine's own measurements, kept per batch-size bucket and interpolated
between measured buckets. An unmeasured size is measured once (exploration); while speculation
is off a short probe (k=1) runs every PROBE_INTERVAL steps so acceptance estimates stay current.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PROBE_INTERVAL = 64
MIN_GAIN = 1.02  # speculate only when expected to be at least this much faster (noise margin)
ACCEPT_PRIOR, PRIOR_WEIGHT, DECAY = 0.5, 2.0, 0.97
COST_EMA = 0.2


def _bucket(n: int) -> int:
    """Exact up to 16 tokens, then four buckets per doubling."""
    return n if n <= 16 else 16 + round(4 * math.log2(n / 16))


@dataclass
class CostModel:
    """Seconds of a step as a function of its size, from measurements."""

    points: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (mean size, seconds)

    def record(self, size: int, seconds: float) -> None:
        b = _bucket(size)
        old = self.points.get(b)
        self.points[b] = (size, seconds) if old is None else (
            old[0] + COST_EMA * (size - old[0]), old[1] + COST_EMA * (seconds - old[1])
        )  # fmt: skip

    def estimate(self, size: int) -> float | None:
        """Measured, or interpolated between the nearest measured sizes around it; None otherwise."""
        exact = self.points.get(_bucket(size))
        if exact is not None:
            return exact[1]
        below = max((p for p in self.points.values() if p[0] <= size), default=None)
        above = min((p for p in self.points.values() if p[0] >= size), default=None)
        if below is None or above is None:
            return None
        if above[0] == below[0]:
            return below[1]
        return below[1] + (above[1] - below[1]) * (size - below[0]) / (above[0] - below[0])


@dataclass
class AdaptiveController:
    max_k: int
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    proposal_cost_per_token: bool = True  # draft model: k draft steps; n-gram: one lookup per round
    target_cost: CostModel = field(default_factory=CostModel)
    proposal_cost: CostModel = field(default_factory=CostModel)  # per draft step (or round), by sequences
    accepted: list[float] = field(default_factory=list)  # decayed counts per draft position
    attempted: list[float] = field(default_factory=list)
    steps_without_spec: int = 0

    def __post_init__(self) -> None:
        self.accepted = [0.0] * self.max_k
        self.attempted = [0.0] * self.max_k

    def acceptance(self, position: int) -> float:
        """P(draft at 0-based position is accepted | the earlier ones were)."""
        return (self.accepted[position] + ACCEPT_PRIOR * PRIOR_WEIGHT) / (self.attempted[position] + PRIOR_WEIGHT)

    def expected_tokens(self, k: int) -> float:
        total, reach = 1.0, 1.0
        for i in range(k):
            reach *= self.acceptance(i)
            total += reach
        return total

    def choose(self, num_spec: int, num_decodes: int, base_tokens: int, num_running: int) -> int:
        """k for this step: num_spec sequences could speculate, num_decodes sequences decode, and the
        step has base_tokens tokens without drafts."""
        if num_spec == 0 or (self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size):
            return 0
        if not self.adaptive:
            return self.max_k
        base = self.target_cost.estimate(base_tokens)
        if base is None:
            return self._no_spec()  # measure the plain step first
        best_k, best_rate = 0, num_decodes / base
        for k in range(1, self.max_k + 1):
            cost = self.target_cost.estimate(base_tokens + num_spec * k)
            if cost is None:
                return k  # unmeasured size: measure it once
            proposal = self.proposal_cost.estimate(num_spec) or 0.0
            cost += proposal * k if self.proposal_cost_per_token else proposal
            rate = (num_decodes + num_spec * (self.expected_tokens(k) - 1)) / cost
            if rate > best_rate * MIN_GAIN:
                best_k, best_rate = k, rate
        if best_k == 0 and self.steps_without_spec >= PROBE_INTERVAL:
            self.steps_without_spec = 0
            return 1
        return best_k if best_k else self._no_spec()

    def _no_spec(self) -> int:
        self.steps_without_spec += 1
        return 0

    def record_step(self, num_tokens: int, seconds: float) -> None:
        self.target_cost.record(num_tokens, seconds)

    def record_proposal(self, num_seqs: int, k: int, seconds: float) -> None:
        self.proposal_cost.record(num_seqs, seconds / k if self.proposal_cost_per_token else seconds)

    def record_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        for i in range(self.max_k):
            self.accepted[i] *= DECAY
            self.attempted[i] *= DECAY
        for i in range(min(num_accepted + 1, num_draft_tokens)):
            self.attempted[i] += 1
            self.accepted[i] += i < num_accepted
        self.steps_without_spec = 0
