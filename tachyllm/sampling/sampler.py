"""Vectorised token sampling over a batch of rows, each with its own SamplingParams.

Every transform is a tensor op over the whole [rows, vocab] batch; Python only loops over
rows to gather parameters and to draw seeded noise. A token is drawn by inverting the row's
CDF at one uniform, which draws from p and lets each seeded request own its noise stream, so
its tokens do not depend on what else is in the batch.

On a GPU a step's sampling does not wait for the device until its one copy of the sampled ids
back to the host (two with logprobs): the parameters go up in pinned memory without blocking
(`to_device`), nothing reads a device value on the host before that, and each seeded row's uniform
comes from its own device generator (a launch, not a sync).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tachyllm.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from tachyllm.step import LogprobInfo, SamplingInput

# The largest penalised logit: divided by the smallest sampling temperature it is still 10x below
# float32's largest value, so a softmax over such logits stays finite.
PENALISED_LIMIT = torch.finfo(torch.float32).max * GREEDY_TEMPERATURE / 10
# Tokens per block of the two-level searches over a row of logits (greedy_tokens, invert_cdf).
BLOCK = 1024


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[LogprobInfo | None]  # per row, when that row asked for logprobs


class SamplingRow(Protocol):
    """What the sampler reads of the sequence a row belongs to: a SamplingInput, or the sequence as
    seen after some of its draft tokens (sampling/verify.py's DraftRow)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator | None: ...

    @property
    def allowed_tokens(self) -> torch.Tensor | None: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


def to_device(values: Sequence[float] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) on `device`. To a GPU through pinned memory without blocking: a
    plain copy from pageable memory waits for the device's queue to drain (a host sync); the caching
    host allocator keeps the pinned block until the copy has run."""
    if device.type == "cpu":
        return torch.as_tensor(values, dtype=dtype)
    return torch.as_tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device, seed: int):
        self.vocab_size = vocab_size
        # An end-of-sequence id outside the sampled vocabulary can never be drawn: nothing to mask or allow.
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.device = device
        # Noise for requests without their own seed: one engine-wide stream, reproducible per engine seed.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> SampleResult:
        """logits: [rows, vocab] float32, row i belongs to seqs[i] and predicts its next token."""
        logits = self.constrain(logits[:, : self.vocab_size], seqs)
        num_logprobs = [s.params.logprobs for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in num_logprobs) else None
        logits = self.process(logits, seqs)
        greedy = [s.params.greedy for s in seqs]
        if all(greedy):
            tokens = greedy_tokens(logits)
        else:
            tokens = self.draw(self.probs(logits, seqs), seqs)
            if any(greedy):
                tokens = torch.where(to_device(greedy, torch.bool, logits.device), greedy_tokens(logits), tokens)
        rows: list[LogprobInfo | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            rows = logprob_rows(raw_logprobs, tokens, num_logprobs)
        return SampleResult(tokens.tolist(), rows)

    def constrain(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """Structured outputs: the tokens its grammar forbids set to -inf in each constrained row, in
        one masked fill over those rows (unconstrained batches return at once). Logprobs are taken
        after this: they are those of the distribution the grammar leaves."""
        masks = [(i, mask) for i, s in enumerate(seqs) if (mask := s.allowed_tokens) is not None]
        if not masks:
            return logits
        rows = [i for i, _ in masks]
        words = torch.stack([mask for _, mask in masks])
        # Little-endian words: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7, lowest bit first.
        bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
        allowed = torch.from_numpy(bits.view(np.bool_))  # 0/1 bytes read as bools, not copied
        # A row the grammar leaves nothing in (its matcher failed) may still end: EOS stays allowed.
        dead = (~allowed.any(dim=1)).nonzero().squeeze(1)
        if len(dead) and self.eos_token_ids:
            allowed[dead.unsqueeze(1), torch.tensor(self.eos_token_ids)] = True
        allowed = to_device(allowed, torch.bool, logits.device)
        if len(rows) == len(seqs):
            return torch.where(allowed, logits, float("-inf"))
        index = to_device(rows, torch.long, logits.device)
        return logits.index_copy(0, index, torch.where(allowed, logits[index], float("-inf")))

    def process(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits a greedy request takes the argmax of: stop tokens masked before min_tokens, tokens
        outside allowed_token_ids or ending a bad word masked, penalties, logit biases."""
        logits = self._suppress_stops_before_min_tokens(logits[:, : self.vocab_size], seqs)
        if any(s.params.restricts_tokens for s in seqs):
            logits = self._restrict_tokens(logits, seqs)
        if any(s.params.uses_penalties for s in seqs):
            logits = self._apply_penalties(logits, seqs)
        if any(s.params.logit_bias for s in seqs):
            logits = self._apply_logit_bias(logits, seqs)
        return logits

    def probs(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution a sampling request draws from: processed logits under temperature,
        top-k / top-p and min-p (greedy rows are treated as temperature 1)."""
        dev = logits.device
        temperature = [1.0 if s.params.greedy else s.params.temperature for s in seqs]
        if any(t != 1.0 for t in temperature):
            logits = logits / to_device(temperature, torch.float32, dev).unsqueeze(1)
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k != -1 for k in top_k) or any(p < 1 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [s.params.min_p for s in seqs]
        if any(m > 0 for m in min_p):
            threshold = to_device(min_p, torch.float32, dev).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        return probs

    def draw(self, probs: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """One token per row from (unnormalised) probs, by inverting the row's CDF at one uniform
        from the row's own noise stream (the engine's for unseeded rows). One random number per row:
        a [rows, vocab] tensor of exponential noise cost more than the rest of a decode step's
        sampling (measurements: docs/design_measurements.md#sampling-noise)."""
        dev = probs.device
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        seeded = [i for i, s in enumerate(seqs) if s.generator is not None]
        counts: list[tuple[int, torch.Generator | None]] = [(len(unseeded), self.generator)] if unseeded else []
        counts += [(1, seqs[i].generator) for i in seeded]
        parts = [torch.rand(n, generator=g, dtype=torch.float64, device=dev) for n, g in counts]
        u = torch.cat(parts)
        if seeded and unseeded:  # each row's uniform to its place
            u = torch.empty_like(u).index_copy_(0, to_device(unseeded + seeded, torch.long, dev), u)
        return invert_cdf(probs, u)

    def uniform(self, count: int, seq: SamplingInput) -> torch.Tensor:
        """count uniforms in [0, 1) from the sequence's own stream (or the engine's)."""
        return torch.rand(count, generator=seq.generator or self.generator, device=self.device)

    def _suppress_stops_before_min_tokens(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        vocab, flat = logits.shape[1], []  # flat (row * vocab + token) indices, as in the methods below
        for i, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens:
                stop_ids = list(s.params.stop_token_ids or ())
                if not s.params.ignore_eos:
                    stop_ids += self.eos_token_ids
                flat += [i * vocab + t for t in stop_ids]
        if flat:
            # index_fill takes the value as a scalar argument: indexed assignment of a Python float would
            # copy it to the device as a tensor, which waits for the device.
            index = to_device(flat, torch.long, logits.device)
            logits = logits.flatten().index_fill(0, index, float("-inf")).view(logits.shape)
        return logits

    def _restrict_tokens(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """-inf for every token outside a row's allowed_token_ids and for the tokens that would end one of
        its bad words now: one host mask over the batch, one transfer."""
        banned = torch.zeros(logits.shape, dtype=torch.bool)
        for i, s in enumerate(seqs):
            if s.params.allowed_token_ids is not None:
                banned[i] = True
                banned[i, s.params.allowed_token_ids] = False
            if s.params.bad_words_token_ids:
                banned[i, bad_word_endings(s.params.bad_words_token_ids, s.output_token_ids)] = True
        return logits.masked_fill(to_device(banned, torch.bool, logits.device), float("-inf"))

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        flat, values = [], []
        for i, s in enumerate(seqs):
            for token, bias in (s.params.logit_bias or {}).items():
                flat.append(i * vocab + token)
                values.append(bias)
        # scatter_add over flat indices: index_put with accumulate=True checks its indices' range on the
        # host (a device sync on a GPU); a token id past the vocabulary was refused with the request.
        index = to_device(flat, torch.long, dev)
        return logits.reshape(-1).scatter_add(0, index, to_device(values, logits.dtype, dev)).view(logits.shape)

    def _apply_penalties(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        n, vocab, dev = len(seqs), logits.shape[1], logits.device
        # Two transfers: the three penalties per row, then the flat (row * vocab + token) indices of
        # outputs and of history, scattered (see _apply_logit_bias: no index_put here).
        values = [s.params.repetition_penalty for s in seqs] + [s.params.presence_penalty for s in seqs]
        values += [s.params.frequency_penalty for s in seqs]
        penalties = to_device(values, torch.float32, dev).view(3, n, 1)
        rep, pres, freq = penalties[0], penalties[1], penalties[2]
        out_flat, all_flat = [], []
        for i, s in enumerate(seqs):
            out_flat += [i * vocab + t for t in s.output_token_ids if t < vocab]
            all_flat += [i * vocab + t for t in s.token_ids if t < vocab]
        index = to_device(out_flat + all_flat, torch.long, dev)
        outputs, history = index[: len(out_flat)], index[len(out_flat) :]
        out_counts = torch.zeros(n * vocab, device=dev).scatter_add_(0, outputs, torch.ones(len(out_flat), device=dev))
        out_counts = out_counts.view(n, vocab)
        seen = torch.zeros(n * vocab, dtype=torch.bool, device=dev).scatter_(0, history, True).view(n, vocab)
        # Repetition penalty (over prompt and output) divides positive logits and multiplies negative ones.
        # Any penalty > 0 is valid, but one below float32's range is 0 here (0 / 0 is NaN), and a tiny or
        # huge one overflows: the penalty is kept in range and the result finite, within a bound that
        # stays finite divided by the smallest temperature, so no row can turn NaN. Masked tokens stay -inf.
        rep = rep.clamp(min=torch.finfo(torch.float32).tiny, max=torch.finfo(torch.float32).max)
        penalised = torch.where(logits > 0, logits / rep, logits * rep).clamp(-PENALISED_LIMIT, PENALISED_LIMIT)
        logits = torch.where(seen & logits.isfinite(), penalised, logits)
        # OpenAI presence / frequency penalties count output tokens only.
        return logits - freq * out_counts - pres * (out_counts > 0)


def bad_word_endings(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: each word's last token where the output ends with
    the tokens before it (vLLM's rule: only generated tokens count, not the prompt's)."""
    endings = []
    for word in bad_words_token_ids:
        before = word[:-1]
        if len(before) <= len(output_token_ids) and output_token_ids[len(output_token_ids) - len(before) :] == before:
            endings.append(word[-1])
    return endings


def logprob_rows(
    raw_logprobs: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]
) -> list[LogprobInfo | None]:
    """Per row with a number of logprobs (the others None): the chosen token's logprob and rank, and
    the top-N. raw_logprobs: [rows, vocab]; tokens: [rows], the token each row is scored for."""
    rows: list[LogprobInfo | None] = [None] * len(num_logprobs)
    k = max(n or 0 for n in num_logprobs)
    chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (raw_logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    columns = [chosen.unsqueeze(1), ranks.unsqueeze(1)]
    if k:
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1)
        columns += [top_lp, top_ids]
    # One copy to the host: float64 holds fp32 logprobs, ranks and token ids exactly.
    host = torch.cat([c.double() for c in columns], dim=1).tolist()
    for i, n in enumerate(num_logprobs):
        if n is not None:
            h = host[i]
            top = zip(h[2 + k : 2 + k + n], h[2 : 2 + n])
            kept = [(int(t), lp) for t, lp in top if lp != float("-inf")]  # a grammar forbade them
            rows[i] = (h[0], int(h[1]), [t for t, _ in kept], [lp for _, lp in kept])
    return rows


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Per row of [rows, vocab], the index of the first largest value: torch.argmax's answer (NaN
    taken as the largest, as there), found among the maxima of blocks of BLOCK first, then in the
    block holding the row's maximum. aten's argmax over each whole row took 7.3 ms for 64 rows of a
    262k vocabulary, this 1.8 (docs/design_measurements.md#sampling-over-a-large-vocabulary)."""
    block = _per_block(logits, torch.amax).argmax(dim=-1)
    columns, _ = _block_columns(block, logits.shape[1])
    return block * BLOCK + logits.gather(1, columns).argmax(dim=-1)


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative share of the row's total exceeds u (one float64
    uniform per row): never a token of probability 0. In two levels, so that no [rows, vocab] float64
    CDF is built (its cumulative sum and its memory were most of a 64-row step's sampling at a
    262k vocabulary: docs/design_measurements.md#sampling-over-a-large-vocabulary): a block of BLOCK tokens is drawn by
    its float32 sum, then a token within it by its float64 CDF at the uniform's remainder. A token's
    chance is its probability times (block sum as summed in float32) / (block sum exactly), within
    float32 rounding of its own share however rare it is (one float64 CDF over the whole row, which
    this replaces, kept that too; a float32 one would not)."""
    vocab = probs.shape[1]
    block, remainder = _first_past(_per_block(probs, torch.sum), u)
    columns, inside = _block_columns(block, vocab)
    offset, _ = _first_past(torch.where(inside, probs.gather(1, columns), 0.0), remainder)
    # A row without a positive share (NaN from an overflow) ends in the last block, past a short tail.
    return (block * BLOCK + offset).clamp_(max=vocab - 1)


def _per_block(values: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """[rows, vocab] -> [rows, blocks]: `reduce` (torch.amax, torch.sum) over each block of BLOCK
    columns, the last block being the tail when BLOCK does not divide the vocabulary."""
    rows, vocab = values.shape
    whole = vocab - vocab % BLOCK
    out = reduce(values[:, :whole].reshape(rows, whole // BLOCK, BLOCK), dim=-1)
    if whole < vocab:
        out = torch.cat([out, reduce(values[:, whole:], dim=-1, keepdim=True)], dim=1)
    return out


def _block_columns(block: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the columns of its chosen block ([rows, BLOCK], clamped into the vocabulary) and
    which of them lie inside it (a tail block is shorter)."""
    columns = block.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=block.device)
    return columns.clamp(max=vocab - 1), columns < vocab


def _first_past(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of non-negative weights [rows, n]: the first index whose cumulative (float64) sum
    exceeds u times the row's total, and how far into that index's weight the point falls (in [0, 1),
    a uniform of its own for a further draw). Rounding can put the point at the very end: the last
    index of positive weight is taken then."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    point = u * cdf[:, -1]
    index = torch.searchsorted(cdf, point.unsqueeze(1), right=True).squeeze(1)
    last_positive = weights.shape[1] - 1 - (weights.flip(1) > 0).to(torch.uint8).argmax(dim=1)
    index = torch.minimum(index, last_positive)
    before = torch.where(index > 0, cdf.gather(1, (index - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    weight = weights.gather(1, index.unsqueeze(1)).squeeze(1).double()
    return index, ((point - before) / weight).clamp(0.0, 1.0 - 2**-53)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k and outside its top-p nucleus."""
    dev, vocab = logits.device, logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = to_device([vocab if x == -1 else min(x, vocab) for x in top_k], torch.long, dev)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = to_device(top_p, torch.float32, dev).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already cover p; the top token always stays.
    drop = (probs.cumsum(dim=-1) - probs) >= p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
