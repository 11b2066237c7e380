"""When does speculation pay? Decide per step from measured costs and acceptance.

Verifying k draft tokens for B sequences makes the target's forward B * k tokens wider, plus a
draft model's own k forwards (n-gram lookups run before the decision either way). It gains,
per speculating sequence, the expected number of tokens emitted: 1 + sum_{i=1..k} prod_{j<=i} a_j,
where a_j is the measured probability that draft position j is accepted given j-1 were (a
position seldom reached borrows the estimate of the one before it). The controller picks the k in
1..max_k, and how many of the sequences with drafts verify them (a power of two up to all: a few
can pay where all would not), with the best expected tokens per second, and speculates if that
beats no speculation by MIN_GAIN. On a CPU at batch 1 a
forward over a few more tokens costs almost nothing (the weights are read once either way), so k
is high; at large batches the forward is compute bound and k falls to 0.

Step costs come from the engine's own measurements, kept per step-size bucket and interpolated
between measured sizes; outside the measured range they are bounded on the side that argues
against speculating. Steps that verify drafts are judged by a table of their own: a verification
runs the LM head and the sampler over every draft position, so it costs more than a plain step
(a prefill chunk) of the same token count, and by plain steps' costs drafts accepted about half
the time looked worth it at batch 8 where they lost
(docs/design_measurements.md#speculative-step-cost). While speculation is off, a probe runs
after PROBE_INTERVAL steps (then after twice as many, and so on while probes keep finding it
does not pay; every
EARLY_PROBE_INTERVAL steps while acceptance has hardly been measured) so acceptance estimates
stay current; while it is on, a plain step runs every REFRESH_INTERVAL steps so the baseline
does too, and a step at k + 1 halfway between: a verification that costs less than linearly more
per token (a CPU's) would otherwise never be measured above the size the probes try. Probes
involve a single sequence: for a draft model a sequence's first round includes prefilling its
prompt, which must not be paid for a whole batch to learn that speculation does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tachyllm.core.step_cost import CostBySize, StepCostModel

PROBE_INTERVAL = 64  # while off: a probe after this many steps, doubling after each probe that
MAX_PROBE_INTERVAL = 2048  # did not turn speculation back on, up to this
REFRESH_INTERVAL = 64  # while on: a plain step every this many steps, and a step one token longer
EARLY_PROBE_INTERVAL = 8  # while acceptance rests on fewer than EARLY_DRAFTS first-position drafts
EARLY_DRAFTS = 8
MIN_GAIN = 1.10  # speculate only when expected to be at least this much faster (noise margin)
# can_skip_proposals reuses a "cannot pay" for this many further steps of the same shape: judging it
# cost ~0.3 ms a step (2% of a batch-8 step; docs/design_measurements.md#adaptive-switch-cost), and it
# changes only as acceptance is measured (which forgets it) or the step costs drift.
SKIP_REUSES = 16
ACCEPT_PRIOR, PRIOR_WEIGHT, DECAY = 0.5, 2.0, 0.97


@dataclass
class AdaptiveController:
    max_k: int
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    # A draft model runs k forwards of its own per round. n-gram lookups run before the decision
    # whatever it is, so they cost nothing that choosing k could save.
    has_draft_model: bool = True
    # The engine's model of a target step's time (the scheduler feeds it every step), and a draft forward's.
    step_costs: StepCostModel = field(default_factory=StepCostModel)
    proposal_cost: CostBySize = field(default_factory=CostBySize)
    accepted: list[float] = field(default_factory=list)  # decayed counts per draft position
    attempted: list[float] = field(default_factory=list)
    steps_without_spec: int = 0
    steps: int = 0  # steps decided so far
    probing: bool = False  # the last decision was a measurement: one sequence speculates, not all
    num_rows: int = 0  # how many of the candidates speculate at the k last chosen (1 for a probe)
    probe_interval: int = PROBE_INTERVAL
    # The step shape (candidates, decodes, base tokens) last judged unable to pay, and how many steps
    # have reused that judgement.
    cannot_pay: tuple[int, int, int] | None = None
    cannot_pay_reuses: int = 0

    def __post_init__(self) -> None:
        self.accepted = [0.0] * self.max_k
        self.attempted = [0.0] * self.max_k

    def acceptances(self) -> list[float]:
        """P(draft at each 0-based position is accepted | the earlier ones were). A position seldom
        reached (probes draft only two tokens) leans on the one before it rather than on a fixed
        prior: acceptance hardly depends on the position once the earlier drafts were right."""
        out, prior = [], ACCEPT_PRIOR
        for accepted, attempted in zip(self.accepted, self.attempted):
            prior = (accepted + prior * PRIOR_WEIGHT) / (attempted + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def expected_tokens(self) -> np.ndarray:
        """[k - 1]: the tokens a sequence is expected to gain from a step verifying k drafts, for k in
        1..max_k (the accepted ones and the token sampled after them)."""
        # Summed from the 1 up, in the order a running total would add them.
        expected: np.ndarray = np.cumsum(np.concatenate([[1.0], np.cumprod(self.acceptances())]))[1:]
        return expected

    def choose(self, num_spec: int, num_decodes: int, base_tokens: int, num_running: int) -> int:
        """k for this step: num_spec sequences could speculate, num_decodes sequences decode, and the
        step has base_tokens tokens without drafts."""
        if num_spec == 0 or (self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size):
            return 0
        self.probing = False
        self.num_rows = num_spec
        if not self.adaptive:
            return self.max_k
        self.steps += 1
        # The plain step is re-measured now and then, so that speculation is never judged against a
        # stale baseline; the proposer's cost must be measured once before it can be judged at all.
        base = self.step_costs.by_size.estimate(base_tokens, high=False)
        if base is None or self.steps % REFRESH_INTERVAL == 0:
            return self._no_spec()
        if self.has_draft_model and not self.proposal_cost.measured_up_to(2 * num_spec):
            # A round of k >= 2 includes one-token draft forwards: measure them (a first round's
            # catch-up forward, a whole prompt, says nothing about the steady state).
            return self._probe(min(2, self.max_k))
        best_k, rows = self._best_choice(num_spec, num_decodes, base_tokens, base)
        if best_k == 0 and self.steps_without_spec >= self._steps_between_probes():
            if not self._early():
                self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
            # Keep the acceptance and cost estimates current: a draft model's probe is short (its
            # forwards cost), an n-gram probe uses every position it may.
            return self._probe(min(2, self.max_k) if self.has_draft_model else self.max_k)
        if best_k:
            self.probe_interval = PROBE_INTERVAL
            if best_k < self.max_k and self.steps % REFRESH_INTERVAL == REFRESH_INTERVAL // 2:
                best_k += 1  # a size never measured is judged by a cautious bound: measure it
            return self._spec(best_k, rows)
        return self._no_spec()

    def _best_choice(self, num_spec: int, num_decodes: int, base_tokens: int, base: float) -> tuple[int, int]:
        """(k, rows): the draft length and the number of the num_spec sequences with drafts that give
        the best expected tokens per second, or (0, 0) unless that beats plain decoding (`base`
        seconds) by MIN_GAIN. Fewer sequences can pay where all of them would not (a step that stays
        small enough for the fused kernels), so every power of two up to num_spec is judged, every k
        at once: one step-cost lookup over all of them (one k at a time in Python cost milliseconds
        per step at max_k 24; docs/design_measurements.md#adaptive-switch-cost)."""
        counts = np.array(sorted({min(num_spec, 1 << i) for i in range(num_spec.bit_length() + 1)}))
        spec = counts[:, None]
        ks = np.arange(1, self.max_k + 1)
        # Verifying steps by their own measured costs (StepCostModel.speculative_estimates).
        steps = self.step_costs.speculative_estimates(base_tokens + spec * ks)
        assert steps is not None, "the callers measured `base`: the plain table has points"
        rates = (num_decodes + spec * (self.expected_tokens() - 1)) / (steps + self.proposal_seconds(spec, ks))
        best = rates.argmax(axis=1)  # the smallest k on a tie
        best_rates = rates[np.arange(len(counts)), best]
        if best_rates.max() < MIN_GAIN * num_decodes / base:
            return 0, 0
        choice = int(best_rates.argmax())  # the fewest rows on a tie
        return int(best[choice]) + 1, int(counts[choice])

    def can_skip_proposals(self, num_candidates: int, num_decodes: int, base_tokens: int) -> bool:
        """Whether this step will not speculate even if all num_candidates sequences had drafts
        and no probe is due, so that proposing (n-gram lookups: a small but real share of a large
        batch's step; measurements: docs/design_measurements.md#n-gram-lookup-cost) can be
        skipped; the step then counts as one without speculation."""
        if not self.adaptive or self.has_draft_model or self.steps_without_spec + 1 >= self._steps_between_probes():
            return False
        shape = (num_candidates, num_decodes, base_tokens)
        if shape == self.cannot_pay and self.cannot_pay_reuses < SKIP_REUSES:
            self.cannot_pay_reuses += 1
        else:
            base = self.step_costs.by_size.estimate(base_tokens, high=False)
            if base is None:
                return False
            # Judged as choose() judges the rows that turn out to have drafts, so that a proposal
            # made is one that some of them can use.
            if self._best_choice(num_candidates, num_decodes, base_tokens, base)[0]:
                self.cannot_pay = None
                return False
            self.cannot_pay, self.cannot_pay_reuses = shape, 0
        self.steps += 1
        self._no_spec()
        return True

    def _early(self) -> bool:
        """Acceptance still rests on a handful of drafts (mostly on its prior)."""
        return self.attempted[0] < EARLY_DRAFTS

    def _steps_between_probes(self) -> int:
        return EARLY_PROBE_INTERVAL if self._early() else self.probe_interval

    def proposal_seconds(self, num_spec: np.ndarray, k: np.ndarray) -> np.ndarray | float:
        """A draft model's round: a catch-up forward over what the target accepted last time
        (about two tokens per sequence) then k - 1 one-token forwards (elementwise over num_spec
        and k; 0 for a lookup)."""
        if not self.has_draft_model:
            return 0.0
        first = self.proposal_cost.estimates(2 * num_spec, high=True)
        later = self.proposal_cost.estimates(num_spec, high=True)
        assert first is not None and later is not None, "choose() measures the proposer before judging it"
        seconds: np.ndarray = first + (k - 1) * later
        return seconds

    def _spec(self, k: int, rows: int) -> int:
        self.steps_without_spec = 0
        self.num_rows = rows
        return k

    def _probe(self, k: int) -> int:
        self.probing = True
        return self._spec(k, 1)

    def _no_spec(self) -> int:
        self.steps_without_spec += 1
        return 0

    def record_proposal(self, size: int, seconds: float) -> None:
        """One draft forward over `size` tokens."""
        self.proposal_cost.record(size, seconds)

    def record_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.cannot_pay = None
        for i in range(self.max_k):
            self.accepted[i] *= DECAY
            self.attempted[i] *= DECAY
        for i in range(min(num_accepted + 1, num_draft_tokens)):
            self.attempted[i] += 1
            self.accepted[i] += i < num_accepted
