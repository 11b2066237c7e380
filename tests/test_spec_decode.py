"""Speculative decoding: configuration, proposers, lossless verification (greedy identity and
distribution preservation), KV rollback, metrics and the adaptive switch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.call_counts import count_calls
from helpers.engine import GREEDY, random_prompts, run, tiny_llm, token_ids
from helpers.models import first_layers, make_tiny_model
from helpers.spec_decode import NGRAM, SUFFIX, draft, with_oracle

from tachyllm import LLM, SamplingParams
from tachyllm.core.sequence import Request, Sequence
from tachyllm.core.step_cost import CostBySize, StepShape
from tachyllm.errors import ConfigError, ModelLoadError
from tachyllm.outputs import RequestMetrics, StepStats
from tachyllm.runner import kv_cache
from tachyllm.sampling import verify as rejection
from tachyllm.sampling.sampler import Sampler
from tachyllm.spec_decode.adaptive import (
    EARLY_DRAFTS,
    EARLY_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    PROBE_INTERVAL,
    REFRESH_INTERVAL,
    SKIP_REUSES,
    AdaptiveController,
)
from tachyllm.spec_decode.ngram import NgramProposer
from tachyllm.speculative_config import SpeculativeConfig
from tachyllm.step import SamplingInput, ScheduledSeq

# -- configuration -------------------------------------------------------------------------------


def test_config_accepts_vllm_shapes_and_json():
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min, c.adaptive) == (
        "ngram",
        5,
        3,
        2,
        True,
    )
    c = SpeculativeConfig.from_dict({"model": "self:layers=4", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.self_layers == 4


@pytest.mark.parametrize(
    "options, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no 'model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "draft_model", "model": "self:int2", "num_speculative_tokens": 2}, "unknown self-draft"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 64}, "'draft_vocab_size' applies to"),
        ({"model": "self:layers=1", "num_speculative_tokens": 2, "draft_vocab_size": 64}, "not to 'self:layers=1'"),
        ({"model": "self:int4", "num_speculative_tokens": 2, "draft_vocab_size": 0}, "draft_vocab_size must be"),
        ({"model": "self:int4", "num_speculative_tokens": 2, "draft_vocab_size": True}, "draft_vocab_size must be"),
        ({"model": "self:int4", "num_speculative_tokens": 2, "draft_vocab_size": "32k"}, "draft_vocab_size must be"),
        ("{not json", "not valid JSON"),
    ],
)
def test_config_rejects_bad_values(options, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict(options)


def test_draft_with_another_vocabulary_is_refused(tiny_model_factory, tmp_path):
    target = tiny_model_factory("llama")
    other = make_tiny_model(tmp_path / "other", "llama")
    vocab = (other / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|im_stop|>"')
    (other / "tokenizer.json").write_text(vocab)
    with pytest.raises(ConfigError, match="does not share the target's vocabulary"):
        tiny_llm(target, speculative_config=draft(str(other)))
    with pytest.raises(ModelLoadError, match="does not exist"):
        tiny_llm(target, speculative_config=draft(str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="1 <= N < 2"):
        tiny_llm(target, speculative_config=draft("self:layers=2"))


# -- n-gram proposer -----------------------------------------------------------------------------


def seq_of(tokens: list[int], params: SamplingParams | None = None, num_prompt: int | None = None) -> Sequence:
    req = Request("r", None, tokens, params or SamplingParams(), RequestMetrics(0.0))
    return Sequence(req, 0, list(tokens), len(tokens) if num_prompt is None else num_prompt)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(1, 3)
    # suffix [7, 8, 9] occurred at 1..3 (followed by 4, 5) and [8, 9] later at 6..7 (followed by 1)
    assert ngram.lookup(seq_of([0, 7, 8, 9, 4, 5, 8, 9, 1, 7, 8, 9]), 2) == [4, 5]
    assert ngram.lookup(seq_of([3, 8, 9, 2, 6, 8, 9]), 5) == [2, 6, 8, 9]
    assert ngram.lookup(seq_of([1, 2, 3, 4]), 3) == []
    assert NgramProposer(2, 2).lookup(seq_of([5, 1, 5]), 3) == []  # only a 1-token match
    # The proposer interface: one draft per sequence, empty where there is no match.
    drafts = ngram.propose([seq_of([3, 8, 9, 2, 6, 8, 9]), seq_of([1, 2, 3, 4])], [2, 3])
    assert [d.token_ids for d in drafts] == [[2, 6], []] and all(d.probs is None for d in drafts)


# -- greedy identity on tiny models ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", [NGRAM, draft("self:layers=1"), draft("self:int4", k=2)], ids=["ngram", "layers", "int4"]
)
def test_greedy_output_is_identical_with_speculation(tiny_model_factory, spec):
    # hidden 128 so that int4 groups divide every layer
    path = tiny_model_factory("llama", hidden_size=128, intermediate_size=256)
    first, second = random_prompts(1, 4, shared=12, tail=(2, 9)), random_prompts(1, 8, shared=12, tail=(2, 9))[4:]
    params = SamplingParams(max_tokens=24, **GREEDY)
    base = tiny_llm(path)
    expected = token_ids(run(base, first, params)) + token_ids(run(base, second, params, prefix="b"))
    llm = tiny_llm(path, speculative_config=spec)
    if spec is NGRAM:
        with_oracle(llm, first + second, expected)
    # The second wave hits the prefix cache that the first wave filled.
    outputs = run(llm, first, params) + run(llm, second, params, prefix="b")
    assert token_ids(outputs) == expected
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.prefix_cache_hits > 0
    per_request = sum(o.metrics.spec_num_accepted_tokens for o in outputs)
    assert per_request == stats.spec_num_accepted_tokens


def test_greedy_identity_with_preemption_and_batch_one(tiny_model_factory):
    path = tiny_model_factory("llama")
    max_len, block_size = 64, 4
    prompts = random_prompts(4, 12, shared=0, tail=(8, 30))
    params = [SamplingParams(max_tokens=max_len - len(p), **GREEDY) for p in prompts]
    expected = token_ids(run(tiny_llm(path, max_model_len=max_len), prompts, params))
    block_bytes = kv_cache.bytes_per_block(tiny_llm(path).engine.model_config, block_size, torch.float32)
    for spec in (NGRAM, draft("self:layers=1")):
        small = tiny_llm(
            path,
            max_model_len=max_len,
            kv_cache_memory=3 * (max_len // block_size) * block_bytes,
            speculative_config=spec,
        )
        alone = tiny_llm(path, max_model_len=max_len, speculative_config=spec)
        if spec is NGRAM:
            with_oracle(small, prompts, expected), with_oracle(alone, prompts, expected)
        assert token_ids(run(small, prompts, params)) == expected
        assert small.engine.stats.num_preemptions > 0 and small.engine.stats.spec_num_accepted_tokens > 0
        assert token_ids(run(alone, prompts[:1], params[:1])) == expected[:1]
        assert alone.engine.stats.spec_num_accepted_tokens > 0


def test_non_speculating_requests_share_the_batch(tiny_model_factory):
    """Penalties, min_tokens, logprobs and short requests next to speculating ones; drafts only
    for some sequences in a step (the others have no proposal), and a sampling request."""
    path = tiny_model_factory("llama")
    prompts = random_prompts(5, 5, shared=0, tail=(5, 12))
    params = [
        SamplingParams(max_tokens=20, **GREEDY),
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=5),
        SamplingParams(max_tokens=3, **GREEDY),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
    ]
    base = run(tiny_llm(path), prompts, params)
    llm = tiny_llm(path, speculative_config=NGRAM)
    references = {tuple(p): e for p, e in zip(prompts, token_ids(base))}
    del references[tuple(prompts[0])]  # this one never gets a proposal
    oracle = llm.engine.speculator.proposer

    def propose(seq: Sequence, k: int) -> list[int]:
        reference = references.get(tuple(seq.token_ids[: seq.num_prompt_tokens]))
        return [] if reference is None else reference[seq.num_output_tokens : seq.num_output_tokens + k]

    oracle.lookup = propose
    spec = run(llm, prompts, params)
    assert token_ids(spec)[:4] == token_ids(base)[:4]
    assert len(spec[4].outputs[0].token_ids) == 20  # sampled: same length, its own tokens
    for b, s in zip(base[1].outputs[0].logprobs, spec[1].outputs[0].logprobs):
        assert b.keys() == s.keys()
        for tok in b:
            assert s[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4) and s[tok].rank == b[tok].rank
    assert [o.outputs[0].finish_reason for o in spec] == [o.outputs[0].finish_reason for o in base]
    assert spec[0].metrics.spec_num_drafts == 0 and spec[1].metrics.spec_num_accepted_tokens > 0


# -- distribution preservation --------------------------------------------------------------------

VOCAB = 8


def markov(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=g) * sharpness  # logits of next token given previous


def emitted_pairs(
    params: SamplingParams, target: torch.Tensor, proposal: torch.Tensor | None, trials: int, k: int, broken: str = ""
) -> np.ndarray:
    """Counts of the first two emitted tokens over `trials` verifications after token 0. proposal:
    draft logits (a draft model) or None (a deterministic proposal: token (t + 1) % VOCAB)."""
    sampler = Sampler(VOCAB, [], torch.device("cpu"), seed=1)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    g = torch.Generator().manual_seed(2)
    draft_sampler = Sampler(VOCAB, [], torch.device("cpu"), seed=3)
    for _ in range(trials):
        seq = seq_of([0], params, num_prompt=1)
        drafts, q_rows, last = [], [], 0
        for j in range(k):
            if proposal is None:
                token = (last + 1) % VOCAB
            else:
                rows = rejection.draft_rows(seq, drafts)[-1:]
                q = draft_sampler.probs(draft_sampler.process(proposal[last].unsqueeze(0), rows), rows)
                q = q / q.sum()
                token = int(torch.multinomial(q[0], 1, generator=g))
                q_rows.append(q[0])
            drafts.append(token)
            last = token
        sampling = SamplingInput(params, seq.token_ids, 1, None, torch.stack(q_rows) if q_rows else None)
        logits = target[[0] + drafts]  # row j: next-token logits after token 0 and drafts[:j]
        if broken == "accept-all":
            tokens = drafts + [0]
        else:
            entry = ScheduledSeq(
                seq_id=seq.seq_id,
                request_id="r",
                start=0,
                token_ids=[0] + drafts,
                num_draft_tokens=k,
                block_table=[],
                seq_len=1,
                completes=True,
                sampling=sampling,
            )
            tokens, _ = rejection.verify(sampler, logits, [entry])[0]
        if len(tokens) < 2:  # rejected at the first position: the second token is drawn anew from the target
            row = rejection.draft_rows(seq, tokens)[-1:]
            second = sampler.draw(sampler.probs(sampler.process(target[tokens[0]].unsqueeze(0), row), row), row)
            tokens = tokens + [int(second)]
        counts[tokens[0], tokens[1]] += 1
    return counts


def expected_pairs(params: SamplingParams, target: torch.Tensor) -> np.ndarray:
    sampler = Sampler(VOCAB, [], torch.device("cpu"), seed=0)
    seq = seq_of([0], params, num_prompt=1)

    def dist(history: list[int]) -> torch.Tensor:  # next-token distribution after 0 + history
        row = rejection.draft_rows(seq, history)[-1:]
        p = sampler.probs(sampler.process(target[([0] + history)[-1]].unsqueeze(0), row), row)[0]
        return (p / p.sum()).double()

    first = dist([])
    return torch.stack([first[a] * dist([a]) for a in range(VOCAB)]).numpy()  # P(a, b) = p(a | 0) p(b | 0 a)


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test over the cells with non-zero expected probability (cells with zero
    probability must be empty: any count there is an outright failure)."""
    n = counts.sum()
    if counts[probs == 0].sum():
        return 0.0
    mask = probs > 0
    expected = probs[mask] * n
    stat = float(((counts[mask] - expected) ** 2 / expected).sum())
    dof = int(mask.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square tail, accurate for these degrees of freedom.
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


SIGNIFICANCE = 1e-3  # a correct sampler fails one run in a thousand


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        # Each case costs 5-20 s on 2 cores: make test-fast keeps the plain one of every proposer.
        pytest.param(SamplingParams(temperature=0.7, top_k=4), marks=pytest.mark.slow),
        pytest.param(SamplingParams(temperature=1.3, top_p=0.8), marks=pytest.mark.slow),
        pytest.param(SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.5), marks=pytest.mark.slow),
    ],
    ids=["plain", "top-k", "top-p", "min-p+penalty"],
)
@pytest.mark.parametrize("proposer", ["draft", "shortlist", "deterministic"])
def test_rejection_sampling_preserves_the_target_distribution(params, proposer):
    target = markov(0, 1.5)
    proposal = markov(1, 1.0) if proposer != "deterministic" else None
    if proposer == "shortlist":  # a draft whose LM head covers half the vocabulary (draft_vocab_size)
        proposal[:, VOCAB // 2 :] = float("-inf")
    counts = emitted_pairs(params, target, proposal, trials=6000, k=3)
    p = chi_square_p_value(counts, expected_pairs(params, target))
    assert p > SIGNIFICANCE, f"chi-square p = {p:.2e}: emitted tokens are not distributed as the target's"


@pytest.mark.parametrize("broken", ["accept-all", "residual-is-p"])
def test_a_broken_acceptance_rule_fails_the_same_test(broken, monkeypatch):
    params = SamplingParams(temperature=1.0)
    target, proposal = markov(0, 1.5), markov(1, 1.0)
    if broken == "residual-is-p":
        # Resample from p instead of max(0, p - q) after a rejection: biased towards the draft.
        real = rejection._rejection_sample

        def biased(sampler, seq, drafts, p, q):
            return real(sampler, seq, drafts, p, None if q is None else torch.zeros_like(q) + 1e-9)

        monkeypatch.setattr(rejection, "_rejection_sample", biased)
    counts = emitted_pairs(params, target, proposal, trials=6000, k=3, broken=broken)
    assert chi_square_p_value(counts, expected_pairs(params, target)) < SIGNIFICANCE


ENGINE_PROMPT = [11, 12, 13, 14]


def second_and_third_tokens(llm: LLM, params: list[SamplingParams], prompt: list[int]) -> dict[tuple[int, ...], int]:
    """How often each (second, third) output token pair came out of one request per params."""
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[1:])
        counts[key] = counts.get(key, 0) + 1
    return counts


def two_sample_p_value(a: dict[tuple[int, ...], int], b: dict[tuple[int, ...], int]) -> float:
    """Pearson's test that two samples come from one distribution (cells under 10 pooled out)."""
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]], dtype=float)
    table = table[:, table.sum(axis=0) >= 10]  # pool rare cells out, as the test requires
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def seeded_sampling(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True, seed=s) for s in range(count)]


@pytest.mark.parametrize("draft_model", ["self:layers=1", "file", "file-shortlist"])
def test_engine_sampling_with_a_draft_matches_sampling_without(tiny_model_factory, tmp_path, draft_model):
    """Two-sample test on the engine: many seeded requests, with and without a draft model (the
    target's first layer, shared or as a separate file, or that file with an LM head over half the
    vocabulary), on a tiny model with a narrowed vocabulary (top_k=6). The first token comes from the
    prefill; the second and third from one verification step (the draft token or its replacement,
    and the bonus)."""
    path = tiny_model_factory("llama")
    shortlist = {}
    if draft_model.startswith("file"):
        shortlist = {"draft_vocab_size": 200} if draft_model == "file-shortlist" else {}
        draft_model = str(first_layers(path, tmp_path / "draft", 1))
    params = seeded_sampling(1500)
    plain = second_and_third_tokens(tiny_llm(path, max_num_seqs=256), params, ENGINE_PROMPT)
    spec_llm = tiny_llm(path, max_num_seqs=256, speculative_config=draft(draft_model, k=1) | shortlist)
    spec = second_and_third_tokens(spec_llm, params, ENGINE_PROMPT)
    assert spec_llm.engine.stats.spec_num_draft_tokens > 0
    assert two_sample_p_value(plain, spec) > SIGNIFICANCE


@pytest.mark.native  # the suffix trees are C++
def test_engine_sampling_with_suffix_drafts_matches_sampling_without(tiny_model_factory):
    """The same two-sample test with suffix decoding's deterministic drafts: the prompt repeats, so
    a request's own tree drafts while its last token is a prompt token, and once the first batch has
    finished the global tree drafts the continuation most frequent among earlier samples, a draft
    the target accepts often and rejects often (rejection sampling against a one-hot proposal)."""
    path = tiny_model_factory("llama")
    prompt = ENGINE_PROMPT * 3
    params = seeded_sampling(1500)
    plain = second_and_third_tokens(tiny_llm(path, max_num_seqs=256), params, prompt)
    spec_llm = tiny_llm(path, max_num_seqs=256, speculative_config=SUFFIX)
    spec = second_and_third_tokens(spec_llm, params, prompt)
    stats = spec_llm.engine.stats
    assert stats.spec_num_draft_tokens > 300
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert two_sample_p_value(plain, spec) > SIGNIFICANCE


# -- metrics, rollback, adaptive switch ------------------------------------------------------------


def test_metrics_follow_vllm_definitions():
    stats = StepStats()
    stats.record_spec(4, 4)
    stats.record_spec(4, 1)
    stats.record_spec(2, 0)
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (3, 10, 5)
    assert stats.spec_accepted_per_pos == [2, 1, 1, 1]
    assert stats.spec_acceptance_rate == pytest.approx(0.5)
    assert stats.spec_mean_acceptance_length == pytest.approx(1 + 5 / 3)


def test_rejected_drafts_leave_no_blocks_behind(tiny_model_factory):
    """Drafts that are always wrong: every step allocates blocks for them and rolls back."""
    path = tiny_model_factory("llama")
    llm = tiny_llm(path, speculative_config={**NGRAM, "num_speculative_tokens": 8})
    proposer = llm.engine.speculator.proposer
    proposer.lookup = lambda seq, k: [1] * k  # token 1 never follows here under greedy (checked below)
    prompts = random_prompts(8, 5, shared=0, tail=(4, 12))
    params = [SamplingParams(max_tokens=30, **GREEDY) for _ in prompts]
    expected = token_ids(run(tiny_llm(path), prompts, params))
    assert all(1 not in t for t in expected)
    assert token_ids(run(llm, prompts, params)) == expected  # run() checks invariants every step
    stats = llm.engine.stats
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == 0


def test_disable_by_batch_size(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = tiny_llm(path, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    llm.engine.speculator.proposer.lookup = lambda seq, k: [7] * k
    prompts = random_prompts(6, 6, shared=0, tail=(4, 9))
    run(llm, prompts, [SamplingParams(max_tokens=8, **GREEDY) for _ in prompts])
    assert llm.engine.stats.spec_num_drafts == 0
    run(llm, prompts[:1], SamplingParams(max_tokens=8, **GREEDY), prefix="one")  # alone: speculates
    assert llm.engine.stats.spec_num_drafts > 0


def test_adaptive_controller_speculates_only_where_it_pays():
    c = AdaptiveController(max_k=4)
    assert c.choose(1, 1, 1, 1) == 0  # the plain step is measured first
    c.step_costs.observe(StepShape(1), 0.010)
    assert c.choose(1, 1, 1, 1) == 2 and c.probing  # then the draft's one-token forward, once
    c.record_proposal(1, 0.0)
    # Memory-bound small steps: 5 tokens cost what 1 does; high acceptance -> full k.
    for n in range(1, 6):
        c.step_costs.observe(StepShape(n), 0.010)
    for _ in range(20):
        c.record_acceptance(4, 4)
    assert c.choose(1, 1, 1, 1) == 4
    # ... except for a plain step now and then, which keeps the baseline current.
    assert [c.choose(1, 1, 1, 1) for _ in range(REFRESH_INTERVAL)].count(0) == 1
    # Poor acceptance: not worth 10% more time per verified token.
    for n in range(1, 6):
        for _ in range(20):
            c.step_costs.observe(StepShape(n), 0.010 * (1 + 0.1 * (n - 1)))
    for _ in range(60):
        c.record_acceptance(4, 0)
    assert c.choose(1, 1, 1, 1) == 0
    # A draft model's own cost counts against it.
    d = AdaptiveController(max_k=4)
    for n in range(1, 6):
        d.step_costs.observe(StepShape(n), 0.010)
    for _ in range(20):
        d.record_acceptance(4, 4)
    d.record_proposal(2, 0.012)  # a catch-up forward over two tokens
    d.record_proposal(1, 0.012)
    assert d.choose(1, 1, 1, 1) == 0
    for _ in range(20):  # cheaper draft forwards (averaged in)
        d.record_proposal(1, 0.001)
        d.record_proposal(2, 0.001)
    assert d.choose(1, 1, 1, 1) == 4
    d.record_proposal(300, 0.5)  # a draft's prefill of a new prompt is not a per-step cost
    assert d.choose(1, 1, 1, 1) == 4

    # Compute-bound large batch: cost linear in tokens -> no speculation ...
    big = AdaptiveController(max_k=4)
    for n in (32, 64, 96, 128, 160):
        big.step_costs.observe(StepShape(n), 0.001 * n)
    big.record_proposal(32, 0.0)
    for _ in range(20):
        big.record_acceptance(4, 1)
    decisions = [big.choose(32, 32, 32, 32) for _ in range(PROBE_INTERVAL + 1)]
    # ... except a probe (one sequence) every PROBE_INTERVAL steps, to keep the estimates current.
    assert decisions.count(0) == PROBE_INTERVAL and decisions[-1] == 2 and big.probing
    # Sizes never measured are judged by cautious bounds, not tried blindly.
    assert big.choose(20, 20, 20, 20) == 0
    # Probes that keep finding no gain come less and less often.
    more = [big.choose(32, 32, 32, 32) for _ in range(8 * PROBE_INTERVAL)]
    assert [i for i, k in enumerate(more) if k] == [2 * PROBE_INTERVAL - 1, 6 * PROBE_INTERVAL]  # gaps 2x, 4x


def test_adaptive_controller_measures_the_next_larger_step_it_could_take():
    """A verification costs less than linearly more per token (a CPU's memory-bound step), but a size
    never measured is judged by a linear bound: without trying k + 1 now and then the controller
    would stay at the k of its probes for good."""
    cost = {1: 0.025, 2: 0.033, 3: 0.040, 4: 0.045, 5: 0.052}  # a Qwen2.5-Coder-1.5B Q4_K_M's, 16-bit activations
    c = AdaptiveController(max_k=4)
    for n in (1, 3):
        c.step_costs.observe(StepShape(n), cost[n])
    c.record_proposal(2, 0.007)
    c.record_proposal(1, 0.0065)
    for _ in range(30):
        c.record_acceptance(2, 2 if _ % 7 else 1)  # ~0.85 per position
    chosen = []
    for _ in range(4 * REFRESH_INTERVAL):
        k = c.choose(1, 1, 1, 1)
        chosen.append(k)
        c.step_costs.observe(StepShape(1 + k), cost[1 + k])
    half = REFRESH_INTERVAL // 2
    assert chosen[: half - 1] == [2] * (half - 1)
    # Size 4 is measured once and k = 3 pays from then on; size 5 (k = 4) is measured and found not to
    # pay, and is measured again once per interval, as the plain step is.
    assert chosen[half - 1] == 3
    for start in range(half, len(chosen) - REFRESH_INTERVAL + 1, REFRESH_INTERVAL):
        interval = chosen[start : start + REFRESH_INTERVAL]
        assert sorted(interval) == [0] + [3] * (REFRESH_INTERVAL - 2) + [4], interval


def test_adaptive_controller_probes_often_until_it_has_seen_some_drafts():
    """An acceptance estimate still at its prior must not keep speculation off for PROBE_INTERVAL
    steps at a time: probes come every EARLY_PROBE_INTERVAL steps until EARLY_DRAFTS first-position
    drafts were judged, then at the usual, growing intervals."""
    c = AdaptiveController(max_k=4)
    for n in range(1, 6):
        c.step_costs.observe(StepShape(n), 0.010 * (1 + 0.5 * (n - 1)))  # pays only if nearly all accepted
    c.record_proposal(2, 0.001)
    c.record_proposal(1, 0.001)
    probes = []
    for step in range(EARLY_DRAFTS * EARLY_PROBE_INTERVAL + 2 * PROBE_INTERVAL):
        if c.choose(1, 1, 1, 1):
            assert c.probing
            probes.append(step)
            c.record_acceptance(2, 0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    early = gaps.index(PROBE_INTERVAL + 1)  # (the counts decay, so a few more than EARLY_DRAFTS probes)
    assert EARLY_DRAFTS - 1 <= early <= EARLY_DRAFTS + 2 and gaps[:early] == [EARLY_PROBE_INTERVAL + 1] * early
    assert gaps[early:] == [PROBE_INTERVAL + 1]
    # The same early probes for n-gram lookups, whose steps skip the lookups until a probe is due.
    ngram = AdaptiveController(max_k=4, has_draft_model=False)
    for n in range(1, 200):
        ngram.step_costs.observe(StepShape(n), 0.001 * n)
    skipped = [ngram.can_skip_proposals(32, 32, 32) for _ in range(EARLY_PROBE_INTERVAL)]
    assert skipped.count(True) == EARLY_PROBE_INTERVAL - 1 and not skipped[-1]


def test_ngram_lookups_are_skipped_while_speculation_cannot_pay():
    """A compute-bound batch: no number of sequences with drafts would pay, so the step skips the
    lookups (counted as a step without speculation) until a probe is due; a cheap verification
    (memory-bound sizes) or a draft model never skips."""
    big = AdaptiveController(max_k=4, has_draft_model=False)
    assert not big.can_skip_proposals(32, 32, 32)  # nothing measured yet
    for n in range(1, 200):
        big.step_costs.observe(StepShape(n), 0.001 * n)
    for _ in range(20):
        big.record_acceptance(4, 1)
    skipped = [big.can_skip_proposals(32, 32, 32) for _ in range(PROBE_INTERVAL)]
    assert skipped.count(True) == PROBE_INTERVAL - 1 and not skipped[-1]  # the probe's step looks up
    assert 4 in [big.choose(32, 32, 32, 32) for _ in range(2)] and big.probing  # (one may be a refresh)
    cheap = AdaptiveController(max_k=4, has_draft_model=False)
    for n in range(1, 200):
        cheap.step_costs.observe(StepShape(n), 0.010 if n <= 48 else 0.001 * n)  # fused up to 48 tokens
    for _ in range(20):
        cheap.record_acceptance(4, 4)
    assert not cheap.can_skip_proposals(32, 32, 32)  # a few sequences with drafts would pay
    draft = AdaptiveController(max_k=4)
    for n in range(1, 200):
        draft.step_costs.observe(StepShape(n), 0.001 * n)
    assert not draft.can_skip_proposals(32, 32, 32)


def test_cost_model_bounds_outside_the_measured_range():
    cost = CostBySize()
    assert cost.estimate(8, high=True) is None
    cost.record(10, 0.010)
    cost.record(40, 0.020)
    assert cost.estimate(25, high=True) == pytest.approx(0.015)  # interpolated
    assert cost.estimate(80, high=True) == pytest.approx(0.040) and cost.estimate(80, high=False) == pytest.approx(
        0.020
    )
    assert cost.estimate(5, high=True) == pytest.approx(0.010) and cost.estimate(5, high=False) == pytest.approx(0.005)


def test_cost_model_estimates_many_sizes_at_once():
    """estimates() over an array is estimate() of each size: measured buckets, interpolation, both bounds."""
    cost = CostBySize()
    assert cost.estimates(np.array([1, 2]), high=True) is None
    for size, seconds in [(1, 0.004), (8, 0.006), (9, 0.0065), (40, 0.020), (41, 0.030), (300, 0.1)]:
        cost.record(size, seconds)
    sizes = np.array([[0, 1, 5, 8, 9, 12], [39, 40, 41, 100, 300, 900]])
    for high in (True, False):
        many = cost.estimates(sizes, high)
        assert many.shape == sizes.shape
        assert many.tolist() == [[cost.estimate(int(n), high) for n in row] for row in sizes]
    assert cost.estimates(np.array([300, 900, 0]), high=True).tolist() == [0.1, pytest.approx(0.3), 0.004]


def test_adaptive_switch_expected_tokens_per_draft_length():
    c = AdaptiveController(max_k=3)
    for _ in range(30):
        c.record_acceptance(3, 1)  # the first position accepted, the second never, the third never reached
    a = c.acceptances()
    assert a[0] > 0.9 and a[1] < 0.1 and a[2] == pytest.approx(a[1])  # an unreached position borrows
    assert c.expected_tokens().tolist() == pytest.approx(
        [1 + a[0], 1 + a[0] + a[0] * a[1], 1 + a[0] + a[0] * a[1] * (1 + a[2])]
    )


def test_adaptive_switch_decision_costs_no_more_at_long_drafts_and_large_batches():
    """Every step of a large batch asks whether any number of drafting sequences could pay, at
    every draft length up to suffix decoding's 24: judged one length at a time in Python that was
    about 18,000 calls a step, milliseconds against a step of tens of them."""
    c = AdaptiveController(max_k=24, has_draft_model=False)
    for n in range(1, 800):
        c.step_costs.observe(StepShape(n), 0.001 * n)
    for _ in range(20):
        c.record_acceptance(24, 1)
    skip, calls = count_calls(lambda: c.can_skip_proposals(32, 32, 32))
    assert skip and calls < 1000
    k, calls = count_calls(lambda: c.choose(32, 32, 32, 32))
    assert k == 0 and calls < 1000


def test_a_cannot_pay_judgement_is_reused_for_steps_of_the_same_shape():
    """Judging whether any drafts could pay costs ~100 calls (7 to reuse); the answer "no" is reused for up
    to SKIP_REUSES further steps of the same shape, and judged again for another shape, after that
    many, or once acceptance is measured (which can turn it)."""
    c = AdaptiveController(max_k=24, has_draft_model=False)
    for n in range(1, 200):
        c.step_costs.observe(StepShape(n), 0.010 if n <= 16 else 0.001 * n)  # fused up to 16 tokens
    for _ in range(20):
        c.record_acceptance(24, 0)
    c.probe_interval = MAX_PROBE_INTERVAL  # no probe falls due here
    calls = [count_calls(lambda: c.can_skip_proposals(4, 4, 4)) for _ in range(SKIP_REUSES + 2)]
    assert all(skip for skip, _ in calls)
    judged = [n > 50 for _, n in calls]
    assert judged == [True] + [False] * SKIP_REUSES + [True]
    assert count_calls(lambda: c.can_skip_proposals(4, 4, 5))[1] > 50  # another shape
    for _ in range(40):
        c.record_acceptance(24, 24)
    assert not c.can_skip_proposals(4, 4, 5)  # judged again: drafts now pay


def test_adaptive_switch_judges_verifying_steps_by_their_own_costs():
    """A verification runs the LM head and the sampler over every draft position, so it costs more
    than a plain step (a prefill chunk) of the same token count: judged by plain steps' costs, drafts
    accepted about half the time pass at batch 8 where they lose. Cheap verifications still pass."""

    def controller(spec_seconds_per_token: float) -> AdaptiveController:
        c = AdaptiveController(max_k=4, has_draft_model=False)
        for n in range(8, 41):
            c.step_costs.observe(StepShape(n), 0.010 + 0.0001 * (n - 8))  # plain steps: memory bound
            c.step_costs.observe(StepShape(n), 0.010 + spec_seconds_per_token * (n - 8), speculative=True)
        for i in range(40):
            c.record_acceptance(2, i % 2)  # the first draft token accepted half the time, the second never
        return c

    cheap = controller(0.0001)
    assert cheap.choose(8, 8, 8, 8) == 1 and not cheap.can_skip_proposals(8, 8, 8)
    dear = controller(0.001)
    assert dear.step_costs.by_size.estimate(12, high=True) == pytest.approx(0.0104)  # the plain table unchanged
    assert dear.choose(8, 8, 8, 8) == 0
    assert dear.can_skip_proposals(8, 8, 8)  # no number of drafting rows pays: not even a lookup
    # Before any verification was measured, plain steps' costs stand in.
    fresh = AdaptiveController(max_k=4, has_draft_model=False)
    for n in range(8, 41):
        fresh.step_costs.observe(StepShape(n), 0.010 + 0.0001 * (n - 8))
    for i in range(40):
        fresh.record_acceptance(2, i % 2)
    assert fresh.choose(8, 8, 8, 8) == 1
    # Verifications measured at a large batch only do not price a batch of one's: below them a
    # plain step's cost stands in, times what they cost over plain steps of their size.
    alone = AdaptiveController(max_k=4, has_draft_model=False)
    for n in range(1, 6):
        alone.step_costs.observe(StepShape(n), 0.010)  # memory bound: 5 tokens cost what 1 does
    for n in (33, 40):
        alone.step_costs.observe(StepShape(n), 0.002 * n, speculative=True)
    for _ in range(20):
        alone.record_acceptance(4, 4)
    assert alone.choose(1, 1, 1, 1) == 4
    for _ in range(20):
        alone.step_costs.observe(StepShape(33), 0.5, speculative=True)  # 7.6x a plain step of 33 tokens
    assert alone.choose(1, 1, 1, 1) == 0


def test_when_only_some_rows_pay_the_switch_names_how_many():
    """Steps cost a plain step's time up to 12 tokens (the fused kernels), then grow steeply: of 8
    rows with drafts, four can verify one token each for free, all of them cannot. The switch
    speculates four, and proposing is not skipped (the proposals made are used)."""
    c = AdaptiveController(max_k=1, has_draft_model=False)
    for n in range(1, 200):
        c.step_costs.observe(StepShape(n), 0.010 if n <= 12 else 0.002 * n)
    for _ in range(20):
        c.record_acceptance(1, 1)
    c.probe_interval = MAX_PROBE_INTERVAL  # no probe falls due here
    assert not c.can_skip_proposals(8, 8, 8)
    assert c.choose(8, 8, 8, 8) == 1 and c.num_rows == 4 and not c.probing
    assert c.choose(3, 8, 8, 8) == 1 and c.num_rows == 3
    # A plain step past the fused sizes: no count of rows verifies for free, nor pays.
    assert c.choose(8, 16, 16, 16) == 0 and c.can_skip_proposals(8, 16, 16)


def test_long_drafts_are_priced_from_plain_steps_above_the_verifications_measured():
    """A batch of one whose first verifications were short: above them a verification is priced as
    a plain step (interpolated up to a measured prefill) times the largest verification's cost over a
    plain step of its size, not by the table's linear bound, which held the drafts to a few tokens."""
    c = AdaptiveController(max_k=24, has_draft_model=False)
    c.step_costs.observe(StepShape(1), 0.040)
    c.step_costs.observe(StepShape(481), 1.5)  # a prompt's prefill
    for n in (2, 3, 4, 5):
        c.step_costs.observe(StepShape(n), 0.042, speculative=True)
    for _ in range(40):
        c.record_acceptance(24, 24)
    # 0.042 * 25 / 5 = 0.21 s by the linear bound; about 0.04 + 24 * 0.003 = 0.11 s from the prefill.
    assert c.step_costs.speculative_estimates(np.array([25]))[0] == pytest.approx(0.112, rel=0.05)
    assert c.choose(1, 1, 1, 1) == 24
    # Verifications far dearer than plain steps of their size scale the estimate above them too.
    for _ in range(20):
        c.step_costs.observe(StepShape(5), 0.4, speculative=True)
    assert c.step_costs.speculative_estimates(np.array([25]))[0] > 0.5


def test_engine_feeds_verifying_steps_to_their_own_cost_table(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = tiny_llm(path, speculative_config={**NGRAM, "adaptive": False})
    llm.engine.speculator.proposer.lookup = lambda seq, k: [7] * k
    step_cost = llm.engine.scheduler.step_cost
    seen: list[tuple[int, bool]] = []
    observe = step_cost.observe

    def recording(shape: StepShape, seconds: float, speculative: bool = False) -> None:
        seen.append((shape.tokens, speculative))
        observe(shape, seconds, speculative)

    step_cost.observe = recording
    runner = llm.engine.runner
    execute = runner.execute
    verifying: list[bool] = []

    def watched(batch):
        verifying.append(any(s.num_draft_tokens for s in batch.seqs))
        return execute(batch)

    runner.execute = watched
    prompts = random_prompts(3, 6, shared=0, tail=(4, 9))
    run(llm, prompts, [SamplingParams(max_tokens=6, **GREEDY) for _ in prompts])
    assert any(verifying) and not all(verifying)
    assert [spec for _, spec in seen] == verifying
    assert len(step_cost.spec_by_size) and len(step_cost.by_size)


@pytest.mark.slow
def test_real_model_greedy_identity(default_model_path):
    prompt = [
        {
            "role": "user",
            "content": "Rewrite with a for loop, changing nothing else:\n\ndef total(xs):\n    s = 0\n    i = 0\n"
            "    while i < len(xs):\n        s += xs[i]\n        i += 1\n    return s\n",
        }
    ]
    params = SamplingParams(temperature=0, max_tokens=64)
    base = LLM(dtype="float32").chat(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    for spec in (NGRAM, draft("self:int4", k=3)):
        llm = LLM(dtype="float32", speculative_config=spec)
        out = llm.chat(prompt, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == base
        assert out.metrics.spec_num_accepted_tokens > 0
