"""SamplingParams validation and the vectorised sampler's masks, penalties and randomness."""

from __future__ import annotations

import pytest
import torch
from helpers.sampling import every_option_batch, row

from tachyllm import SamplingParams
from tachyllm.sampling.sampler import BLOCK, Sampler, greedy_tokens, invert_cdf

VOCAB = 8


def draw(logits: list[float], params: SamplingParams, n: int = 4000) -> torch.Tensor:
    """Samples n rows at once (one batch) and returns the token counts."""
    sampler = Sampler(VOCAB, eos_token_ids=[7], device=torch.device("cpu"), seed=0)
    batch = torch.tensor([logits] * n)
    tokens = sampler(batch, [row(params) for _ in range(n)]).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("max_tokens", 0),
        ("n", 0),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("logprobs", -1),
        ("min_tokens", 100),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-1]),
        ("seed", 1.5),
        ("max_tokens", 2.5),
    ],
)
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_temperature_sampling_follows_softmax():
    logits = [2.0, 1.0, 0.5, 0.0, -1.0, -1.0, -2.0, -3.0]
    counts = draw(logits, SamplingParams(temperature=0.7))
    expected = torch.softmax(torch.tensor(logits) / 0.7, dim=0) * counts.sum()
    # Chi-square against the exact distribution; 7 degrees of freedom, p = 0.001 critical value 24.3.
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3, (counts, expected)


def test_top_k_top_p_min_p_masks():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]) + 1e-9
    logits = probs.log().tolist()
    assert set(draw(logits, SamplingParams(top_k=2)).nonzero().flatten().tolist()) == {0, 1}
    # The first two tokens already cover 0.8, so the third is outside the nucleus.
    assert set(draw(logits, SamplingParams(top_p=0.8)).nonzero().flatten().tolist()) == {0, 1}
    assert set(draw(logits, SamplingParams(top_p=0.81)).nonzero().flatten().tolist()) == {0, 1, 2}
    # min_p 0.2 keeps tokens with p >= 0.2 * 0.5 = 0.1.
    assert set(draw(logits, SamplingParams(min_p=0.2)).nonzero().flatten().tolist()) == {0, 1, 2}
    # top_p keeps at least the top token however small p is.
    assert set(draw(logits, SamplingParams(top_p=0.01)).nonzero().flatten().tolist()) == {0}


@pytest.mark.parametrize("vocab", [7, BLOCK, 3 * BLOCK + 5])
def test_greedy_tokens_are_argmax_with_its_ties(vocab):
    """The two-level search answers as torch.argmax does: the first of tied maxima (here across block
    boundaries too), a row of -inf, a NaN taken as the largest."""
    torch.manual_seed(0)
    logits = torch.randint(-3, 4, (6, vocab)).float()  # many ties
    logits[1] = float("-inf")
    logits[2, -1] = float("nan")
    logits[3, vocab // 2] = 9.0
    logits[3, -1] = 9.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    padded = torch.cat([logits, torch.full((6, 3), 99.0)], dim=1)[:, :vocab]  # a column slice, as the sampler takes
    assert torch.equal(greedy_tokens(padded), logits.argmax(dim=-1))


def test_inverted_cdf_is_the_whole_rows_cdf():
    """In float64 (block sums exact to rounding) the two-level draw picks, for every uniform, the token
    that one CDF over the whole row picks; zero blocks, zero tokens at block edges and the tail block
    included, and uniforms at 0 and just below 1."""
    torch.manual_seed(1)
    vocab = 3 * BLOCK + 300
    probs = torch.rand(4, vocab, dtype=torch.float64) ** 4
    probs[0, BLOCK : 2 * BLOCK] = 0  # a whole block of zeros
    probs[1, BLOCK - 3 : BLOCK + 3] = 0  # zeros across an edge
    probs[2, :] = 0
    probs[2, [5, BLOCK, vocab - 1]] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)  # three tokens only
    probs[3, 3 * BLOCK :] = 0  # the tail block empty
    probs[3, 3 * BLOCK - 1] = 0
    cdf = probs.cumsum(dim=-1)
    last_positive = torch.tensor([max(row.nonzero().flatten().tolist()) for row in probs])
    uniforms = torch.cat([torch.tensor([0.0, 1 - 2**-53]), torch.rand(2000, dtype=torch.float64)])
    for u in uniforms.split(4):
        u = u.repeat(4)[:4] if len(u) < 4 else u
        past = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        assert torch.equal(invert_cdf(probs, u), torch.minimum(past, last_positive))
    drawn = torch.cat([invert_cdf(probs[2:3], u.reshape(1)) for u in uniforms[:300]])
    assert set(drawn.tolist()) == {5, BLOCK, vocab - 1}


@pytest.mark.parametrize("vocab", [2 * BLOCK, 2 * BLOCK + 10])
def test_rows_without_a_positive_share_still_give_a_token_of_the_vocabulary(vocab):
    """NaN (an overflow upstream) or all-zero rows: some token id in range, never past the tail (as the
    single CDF's clamp gave); and a batch of no rows gives no tokens."""
    probs = torch.rand(3, vocab)
    probs[0] = float("nan")
    probs[1] = 0.0
    tokens = invert_cdf(probs, torch.tensor([0.5, 0.999, 0.1], dtype=torch.float64))
    assert ((tokens >= 0) & (tokens < vocab)).all(), tokens
    assert invert_cdf(probs[:0], torch.zeros(0, dtype=torch.float64)).shape == (0,)
    assert greedy_tokens(probs[:0]).shape == (0,)


def test_no_zero_probability_token_at_block_ends():
    """float32 probabilities whose block sums round: uniforms at the very end of each block and of the row
    still land on tokens of positive probability."""
    vocab = 2 * BLOCK + 10
    probs = torch.zeros(3, vocab)
    probs[:, BLOCK - 1] = 1e-3
    probs[:, 10] = 0.3
    probs[:, BLOCK + 7] = 0.7 + 1e-7
    probs[:, 2 * BLOCK + 2] = 1e-30
    u = torch.tensor([1 - 2**-53, 0.3 / (1.0 + 1e-3), 0.0], dtype=torch.float64)
    tokens = invert_cdf(probs, u)
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens.tolist())), tokens


def test_sampling_over_blocks_follows_softmax():
    """Chi-square of draws over a vocabulary of several blocks and a tail: the mass sits in tokens spread
    across the blocks."""
    vocab = 3 * BLOCK + 17
    hot = [3, BLOCK - 1, BLOCK, 2 * BLOCK + 500, vocab - 1]
    logits = torch.full((vocab,), -30.0)
    logits[hot] = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.8])
    sampler = Sampler(vocab, eos_token_ids=[0], device=torch.device("cpu"), seed=0)
    n = 4000
    tokens = torch.tensor(sampler(logits.repeat(n, 1), [row(SamplingParams(temperature=1.0))] * n).token_ids)
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts.sum() == counts[hot].sum()  # the rest has probability ~1e-13 each
    expected = torch.softmax(logits, dim=0)[hot] * n
    chi2 = ((counts[hot] - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.5, (counts[hot], expected)  # 4 degrees of freedom, p = 0.001


def test_penalties_change_greedy_choice():
    sampler = Sampler(VOCAB, eos_token_ids=[7], device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    greedy = dict(temperature=0)
    assert sampler(logits, [row(SamplingParams(**greedy), output=[0])]).token_ids == [0]
    # repetition: 3.0 / 1.1 < 2.9 (token 0 appears in the prompt)
    assert sampler(logits, [row(SamplingParams(repetition_penalty=1.1, **greedy), prompt=[0])]).token_ids == [1]
    assert sampler(logits, [row(SamplingParams(presence_penalty=0.2, **greedy), output=[0])]).token_ids == [1]
    assert sampler(logits, [row(SamplingParams(frequency_penalty=0.06, **greedy), output=[0, 0])]).token_ids == [1]
    # Presence and frequency penalties ignore prompt tokens.
    assert sampler(logits, [row(SamplingParams(presence_penalty=0.2, **greedy), prompt=[0])]).token_ids == [0]


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e-30, 1e30, 1e300])
@pytest.mark.parametrize("temperature", [0, 1e-5, 1.0])
def test_extreme_repetition_penalties_keep_rows_finite(penalty, temperature):
    """Any penalty > 0 is accepted; one that is 0, tiny or infinite in float32 must not make a row NaN
    (found by the API fuzzer: repetition_penalty 5e-324 picked an arbitrary token). Masked tokens
    stay masked."""
    sampler = Sampler(VOCAB, eos_token_ids=[7], device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[3.0, 0.0, -2.0, 1.0, float("-inf"), 0.5, -0.5, 2.0]] * 64)
    rows = [row(SamplingParams(repetition_penalty=penalty, temperature=temperature), prompt=[0, 1, 2, 4])] * 64
    processed = sampler.process(logits, rows)
    assert not processed.isnan().any() and processed[:, 4].eq(float("-inf")).all()
    probs = sampler.probs(processed, rows)
    assert torch.isfinite(probs).all() and (probs[:, 4] == 0).all()
    tokens = sampler(logits, rows).token_ids
    assert 4 not in tokens
    if penalty < 1 and temperature < 1:  # tiny penalties make the seen token 0 (3.0) unbeatable
        assert set(tokens) == {0}
    if penalty > 1:  # huge ones: seen 3.0 -> ~0, seen -2.0 -> never; greedy takes the unseen 7 (2.0)
        assert 2 not in tokens and (temperature > 1e-5 or set(tokens) == {7})


def test_min_tokens_suppresses_eos_and_stop_ids():
    sampler = Sampler(VOCAB, eos_token_ids=[7], device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 0, 0, 0, 0, 5.0, 0, 9.0]])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sampler(logits, [row(p, output=[1])]).token_ids == [0]
    assert sampler(logits, [row(p, output=[1, 2])]).token_ids == [7]


def test_min_tokens_masks_only_its_own_row_with_an_eos_id_outside_the_vocabulary():
    """A model whose EOS id lies past the sampled vocabulary: the masks are flat indices, so such an id
    must not spill into the next row's tokens (it can never be drawn anyway)."""
    sampler = Sampler(VOCAB, eos_token_ids=[7, VOCAB + 1], device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 0, 0, 0, 0, 5.0, 0, 9.0], [0.0, 0, 0, 0, 0, 0, 0, 0]])
    logits[1, 1] = 9.0  # token VOCAB + 1 of row 0, read flat
    p = SamplingParams(temperature=0, min_tokens=2)
    assert sampler(logits, [row(p, output=[1]), row(SamplingParams(temperature=0))]).token_ids == [5, 1]


def test_seeded_rows_do_not_depend_on_the_batch():
    sampler = Sampler(VOCAB, eos_token_ids=[7], device=torch.device("cpu"), seed=0)
    logits = torch.zeros(1, VOCAB)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [sampler(logits, [row(p, seed=1234)]).token_ids[0] for _ in range(1)]
    seq = row(p, seed=1234)
    others = [row(SamplingParams(temperature=1.0)) for _ in range(5)]
    batched = sampler(torch.zeros(6, VOCAB), others[:3] + [seq] + others[3:]).token_ids[3]
    assert alone[0] == batched


def test_logprobs_are_log_softmax_of_raw_logits():
    sampler = Sampler(VOCAB, eos_token_ids=[7], device=torch.device("cpu"), seed=0)
    logits = torch.randn(2, VOCAB)
    res = sampler(
        logits, [row(SamplingParams(temperature=0, logprobs=3)), row(SamplingParams(temperature=0, logprobs=0))]
    )
    ref = torch.log_softmax(logits, dim=-1)
    chosen, rank, top_ids, top_lps = res.logprobs[0]
    assert rank == 1 and abs(chosen - ref[0].max().item()) < 1e-6
    assert top_ids == ref[0].topk(3).indices.tolist()
    assert torch.allclose(torch.tensor(top_lps), ref[0].topk(3).values)
    assert res.logprobs[1][2] == [] and res.logprobs[1][1] == 1


def test_every_option_samples_as_before():
    """Three steps of a batch using every option give the tokens and logprobs the sampler gave before it
    moved its parameters to the device without syncs (recorded from that version)."""
    torch.manual_seed(0)
    logits = torch.randn(36, 20) * 2
    sampler = Sampler(20, eos_token_ids=[19], device=torch.device("cpu"), seed=3)
    steps = [sampler(logits, every_option_batch()) for _ in range(3)]
    expected = [
        "13 3 19 9 9 7 14 7 4 2 17 5 14 11 19 16 17 10 11 13 14 2 12 1 13 10 18 17 13 3 5 0 17 2 1 0",
        "13 3 5 9 9 16 14 7 4 2 17 1 14 0 1 16 17 17 11 13 14 2 12 18 13 18 18 17 13 15 5 0 15 2 1 6",
        "13 3 5 9 9 10 14 7 4 2 17 17 14 10 6 16 17 10 11 13 14 2 12 1 13 10 18 17 5 15 5 0 13 2 1 0",
    ]
    assert [s.token_ids for s in steps] == [[int(t) for t in line.split()] for line in expected]
    # Logprobs to float rounding: log_softmax's vectorised sums differ in the last bit between CPU kinds.
    close = pytest.approx
    chosen, rank, top_ids, top_logprobs = steps[0].logprobs[10]
    assert (chosen, rank, top_ids) == (close(-1.663047432899475), 1, [17, 8, 13])
    assert top_logprobs == close([-1.663047432899475, -1.888024926185608, -2.25653076171875])
    assert steps[0].logprobs[11] == (close(-0.926486074924469), 1, [], [])
    assert steps[0].logprobs[:10] == [None] * 10


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_step_reads_the_device_once(monkeypatch, logprobs):
    """On a GPU every read of a device value on the host, and every blocking copy to it, waits for the
    device: a step's sampling with every option reads once (the sampled ids), and once more for
    logprobs when a row asks for them; its parameters go up through to_device."""
    reads = []
    for name in ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    # A tensor made from host values straight on the device is a blocking (syncing) copy on a GPU.
    make = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            reads.append("tensor(device=...)")
        return make(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    rows = every_option_batch()
    if not logprobs:
        rows = [r for r in rows if r.params.logprobs is None]
    Sampler(20, eos_token_ids=[19], device=torch.device("cpu"), seed=3)(torch.randn(len(rows), 20), rows)
    assert reads == ["tolist"] * (1 + logprobs)
