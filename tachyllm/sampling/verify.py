"""Verification of draft tokens against the target model's distributions, losslessly.

For a sequence with drafts d_1..d_k, the target's forward gives k + 1 rows: row j is the target's
next-token distribution p_j after the sequence and d_1..d_j. Going left to right:

- greedy requests accept d_{j+1} while it equals the target's argmax of row j; the first mismatch
  is replaced by that argmax, and if all k are accepted row k adds a bonus token. The output is
  the target's greedy output, token for token;
- sampling requests use modified rejection sampling: accept d_{j+1} with probability
  min(1, p_j(d) / q_j(d)), where q_j is the distribution the draft was drawn from (a one-hot for a
  deterministic proposal such as n-gram lookup); on the first rejection draw the replacement from
  normalize(max(0, p_j - q_j)); if all are accepted draw the bonus from p_k. Each emitted token is
  then distributed exactly as p_j, so the output distribution equals the target's.

p_j is exactly what the sampler would draw from without speculation: the grammar's mask after
d_1..d_j (structured outputs), min_tokens masking, penalties over the history including d_1..d_j,
temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tachyllm.sampling.sampler import Sampler, greedy_tokens, logprob_rows, to_device
from tachyllm.sampling_params import SamplingParams
from tachyllm.step import LogprobInfo, SamplingInput, ScheduledSeq


@dataclass(eq=False)
class DraftRow:
    """A sequence as seen by the target row that follows its first `len(drafts)` draft tokens: the
    sampler reads history (penalties, min_tokens) from here."""

    seq: SamplingInput
    drafts: list[int]

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator

    @property
    def allowed_tokens(self) -> torch.Tensor | None:
        return None if self.seq.token_bitmask is None else self.seq.token_bitmask[len(self.drafts)]

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)


def draft_rows(seq: SamplingInput, drafts: list[int]) -> list[DraftRow]:
    return [DraftRow(seq, drafts[:j]) for j in range(len(drafts) + 1)]


def sampling_input(s: ScheduledSeq) -> SamplingInput:
    """What sampling reads of a sequence that reaches its next token this step (it has one)."""
    assert s.sampling is not None, "a sequence that completes its step samples its next token"
    return s.sampling


def verify(
    sampler: Sampler, logits: torch.Tensor, spec: list[ScheduledSeq]
) -> list[tuple[list[int], list[LogprobInfo | None]]]:
    """logits: [sum(k_i + 1), vocab], the rows of each speculating sequence in order. Returns, per
    sequence, the emitted tokens (accepted drafts + one target token) and their logprob entries."""
    rows = [row for s in spec for row in draft_rows(sampling_input(s), s.draft_token_ids)]
    first_rows = [0]
    for s in spec:
        first_rows.append(first_rows[-1] + s.num_draft_tokens + 1)
    logits = sampler.constrain(logits[:, : sampler.vocab_size], rows)
    want_logprobs = any(sampling_input(s).params.logprobs is not None for s in spec)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    processed = sampler.process(logits, rows)
    argmaxes = greedy_tokens(processed).tolist()
    # Target distributions, only for the rows of sampling requests: row index -> row of `probs`.
    sampled = [
        r
        for i, s in enumerate(spec)
        if not sampling_input(s).params.greedy
        for r in range(first_rows[i], first_rows[i + 1])
    ]
    probs = None
    if sampled:
        probs = sampler.probs(processed[to_device(sampled, torch.long, logits.device)], [rows[r] for r in sampled])
    position = {r: j for j, r in enumerate(sampled)}

    out = []
    for i, s in enumerate(spec):
        drafts, first, seq = s.draft_token_ids, first_rows[i], sampling_input(s)
        if seq.params.greedy:
            target = argmaxes[first : first_rows[i + 1]]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            tokens = drafts[:accepted] + [target[accepted]]
        else:
            assert probs is not None, "a sampling request's rows are in `sampled`"
            p = probs[position[first] : position[first] + len(drafts) + 1]
            tokens = _rejection_sample(sampler, seq, drafts, p, seq.draft_probs)
        logprobs: list[LogprobInfo | None] = [None] * len(tokens)
        if seq.params.logprobs is not None:
            emitted = slice(first, first + len(tokens))
            chosen = to_device(tokens, torch.long, logits.device)
            assert raw_logprobs is not None, "want_logprobs covers this sequence"
            logprobs = logprob_rows(raw_logprobs[emitted], chosen, [seq.params.logprobs] * len(tokens))
        out.append((tokens, logprobs))
    return out


def _rejection_sample(
    sampler: Sampler, seq: SamplingInput, drafts: list[int], p: torch.Tensor, q: torch.Tensor | None
) -> list[int]:
    """p: [k + 1, vocab] target distributions (unnormalised after min-p); q: [k, vocab] draft
    distributions, or None for a deterministic proposal."""
    k = len(drafts)
    p = p / p.sum(dim=-1, keepdim=True)
    draft_ids = to_device(drafts, torch.long, p.device)
    p_draft = p[:k].gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    q_draft = torch.ones_like(p_draft) if q is None else q[:k].gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    # u < p/q accepts with probability min(1, p/q); q(d) > 0 because d was drawn from q.
    accept = (sampler.uniform(k, seq) * q_draft < p_draft).tolist()
    accepted = accept.index(False) if False in accept else k
    if accepted == k:
        return drafts + [int(sampler.draw(p[k : k + 1], [seq])[0])]
    q_row = torch.zeros_like(p[accepted]) if q is None else q[accepted]
    if q is None:
        q_row[drafts[accepted]] = 1.0
    residual = (p[accepted] - q_row).clamp_min(0)
    if not residual.sum() > 0:  # p == q up to rounding: the rejection had probability ~0
        residual = p[accepted]
    return drafts[:accepted] + [int(sampler.draw(residual.unsqueeze(0), [seq])[0])]
