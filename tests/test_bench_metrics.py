"""`tachy bench` arithmetic on synthetic timestamps: no server, no model (except one tokenizer test)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tachyllm.bench.client import chunk_text, error_message, parse_counters, root_url
from tachyllm.bench.datasets import DatasetSpec, build_sessions, sample_lengths
from tachyllm.bench.metrics import (
    RequestResult,
    compute_metrics,
    cost,
    meets_slos,
    peak_output_throughput,
    server_stats,
)
from tachyllm.bench.serve import arrival_offsets, parse_slos


def results() -> list[RequestResult]:
    return [
        # 4 tokens: TTFT 100 ms, ITLs 100/100/200 ms, E2EL 500 ms, TPOT (500 - 100) / 3 ms.
        RequestResult(prompt_len=10, start=0.0, chunk_times=[0.1, 0.2, 0.3, 0.5], end=0.5, output_len=4),
        # 1 token: TTFT 300 ms, no TPOT, no ITL.
        RequestResult(prompt_len=20, start=1.0, chunk_times=[1.3], end=1.3, output_len=1),
        RequestResult(prompt_len=30, start=0.0, end=0.01, error="HTTP 400: too long"),
    ]


def test_per_request_definitions():
    r, one, _ = results()
    assert r.ttft == pytest.approx(0.1)
    assert r.latency == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.4 / 3)
    assert r.itls == pytest.approx([0.1, 0.1, 0.2])
    assert one.tpot is None and one.itls == []


def test_compute_metrics():
    m = compute_metrics(results(), start=0.0, end=2.0, percentiles=[90, 99])
    assert (m.completed, m.failed, m.errors) == (2, 1, {"HTTP 400: too long": 1})
    assert m.duration_s == pytest.approx(2.0)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 5)  # failed requests count no tokens
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(17.5)
    assert m.ttft_ms == pytest.approx({"mean": 200, "median": 200, "p90": 280, "p99": 298})
    assert m.tpot_ms["mean"] == pytest.approx(400 / 3)  # the one-token request has no TPOT
    # ITLs are pooled over requests, then summarized (numpy's linear-interpolation percentiles).
    assert m.itl_ms == pytest.approx({"mean": 400 / 3, "median": 100, "p90": 180, "p99": 198})
    assert m.e2el_ms["mean"] == pytest.approx(400)
    assert m.goodput is None and m.cost is None
    assert m.peak_output_throughput == pytest.approx(4.0)  # 4 tokens within (-0.5, 0.5]


def test_goodput_needs_every_slo():
    ok, one, _ = results()
    assert meets_slos(ok, {"ttft": 200}) and not meets_slos(one, {"ttft": 200})
    assert not meets_slos(ok, {"tpot": 100}) and meets_slos(one, {"tpot": 100})  # one token: TPOT 0
    assert meets_slos(one, {"e2el": 400}) and not meets_slos(ok, {"e2el": 400})
    for slos, good in (({"ttft": 200}, 1), ({"tpot": 100}, 1), ({"ttft": 200, "tpot": 100}, 0), ({"ttft": 1000}, 2)):
        m = compute_metrics(results(), 0.0, 2.0, [99], slos)
        assert (m.good_requests, m.goodput) == (good, pytest.approx(good / 2.0))
    assert parse_slos(["ttft:500", "e2el:2500.5"]) == {"ttft": 500.0, "e2el": 2500.5}
    with pytest.raises(ValueError):
        parse_slos(["latency:5"])


def test_peak_output_throughput():
    a = RequestResult(1, 0.0, [0.1, 0.15, 1.05, 1.1, 1.15, 1.2], 1.2, output_len=6)
    b = RequestResult(1, 0.0, [1.0, 2.5], 2.5, output_len=4)  # 2 tokens per chunk
    # The busiest second (0.2, 1.2] holds a's last four chunks and b's first: 4 + 2 tokens.
    assert peak_output_throughput([a, b], duration=3.0) == pytest.approx(6.0)
    # A run shorter than the window: all tokens over the run's length.
    short = RequestResult(1, 0.0, [0.1, 0.2, 0.25], 0.25, output_len=3)
    assert peak_output_throughput([short], duration=0.25) == pytest.approx(12.0)


def test_cost():
    c = cost(3.6, output_throughput=2.5, request_throughput=1.0)  # $0.001 a second
    assert c.usd_per_million_output_tokens == pytest.approx(400.0)
    assert c.usd_per_1k_requests == pytest.approx(1.0)
    assert cost(3.6, 0.0, 0.0).usd_per_million_output_tokens is None
    m = compute_metrics(results(), 0.0, 2.0, [99], usd_per_hour=3.6)
    assert m.cost.usd_per_million_output_tokens == pytest.approx(400.0)


TACHY_METRICS = """\
# TYPE tachy:prefix_cache_queries counter
tachy:prefix_cache_queries_total{model_name="m"} 300.0
# TYPE tachy:prefix_cache_hits counter
tachy:prefix_cache_hits_total{model_name="m"} 75.0
# TYPE tachy:generation_tokens counter
tachy:generation_tokens_total{model_name="m"} 9.0
"""
VLLM_METRICS = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
"""


def test_server_stats_from_metrics():
    after = parse_counters(TACHY_METRICS)
    m = (("model_name", "m"),)
    assert after == {("prefix_cache_queries", None, m): 300.0, ("prefix_cache_hits", None, m): 75.0}
    stats = server_stats({("prefix_cache_queries", None, m): 100.0, ("prefix_cache_hits", None, m): 25.0}, after)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.25)
    assert stats.spec_decode is None  # tachy exports no spec-decode counters: nothing is reported

    spec = server_stats({}, parse_counters(VLLM_METRICS)).spec_decode
    assert spec.acceptance_rate == pytest.approx(0.5)
    assert spec.mean_acceptance_length == pytest.approx(2.5)
    assert spec.acceptance_per_position == pytest.approx([0.8, 0.5, 0.2])
    assert server_stats({}, parse_counters(VLLM_METRICS)).prefix_cache_hit_rate is None


def test_server_stats_follow_each_series_as_replicas_come_and_go():
    """A scale-out ingress merges its replicas' counters, each with a replica label: a replica gone
    before the run ends counts nothing (its figures may still show in the first scrape), one that
    started during it counts from 0, and so does a series that went back (a restarted server)."""

    def scrape(values: dict[str, tuple[float, float]]) -> dict:
        lines = ["# TYPE tachy:prefix_cache_queries counter", "# TYPE tachy:prefix_cache_hits counter"]
        for replica, (queries, hits) in values.items():
            lines.append(f'tachy:prefix_cache_queries_total{{model_name="m",replica="{replica}"}} {queries}')
            lines.append(f'tachy:prefix_cache_hits_total{{model_name="m",replica="{replica}"}} {hits}')
        return parse_counters("\n".join(lines) + "\n")

    before = scrape({"old": (1000.0, 900.0), "kept": (100.0, 50.0), "restarted": (500.0, 400.0)})
    after = scrape({"kept": (300.0, 200.0), "new": (100.0, 10.0), "restarted": (40.0, 20.0)})
    stats = server_stats(before, after)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (200.0 + 100.0 + 40.0, 150.0 + 10.0 + 20.0)
    assert stats.prefix_cache_hit_rate == pytest.approx(180.0 / 340.0)


def test_stream_parsing_helpers():
    assert chunk_text({"choices": [{"index": 0, "text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "x"}}]}) == "x"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert error_message('{"error": {"message": "bad", "type": "x"}}') == "bad"
    assert error_message('{"detail": "nope"}') == "nope"
    assert error_message("Internal Server Error") == "Internal Server Error"
    assert root_url("http://h:1/v1/") == root_url("http://h:1") == "http://h:1"


def test_arrivals():
    rng = np.random.default_rng(0)
    assert arrival_offsets(3, math.inf, 1.0, rng) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(4000, 20.0, 1.0, rng)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert np.mean(np.diff(offsets)) == pytest.approx(1 / 20, rel=0.05)
    bursty = np.diff(arrival_offsets(4000, 20.0, 0.25, rng))
    assert np.mean(bursty) == pytest.approx(1 / 20, rel=0.1)
    assert np.std(bursty) > 1.5 * np.std(np.diff(offsets))  # same mean, burstier


def test_lengths_and_datasets(tiny_model_factory):
    rng = np.random.default_rng(0)
    lengths = sample_lengths(100, 0.5, 1000, rng)
    assert min(lengths) >= 50 and max(lengths) <= 150
    assert sample_lengths(7, 0.0, 3, rng) == [7, 7, 7]

    from tachyllm.loading import load_checkpoint

    tok = load_checkpoint(str(tiny_model_factory("llama"))).tokenizer
    random = build_sessions(DatasetSpec("random", 5, input_len=40, output_len=8), tok, rng)
    assert len(random) == 5 and all(len(s.turns) == 1 and s.turns[0].output_len == 8 for s in random)
    assert all(abs(len(tok.encode(s.turns[0].text)) - 40) <= 4 for s in random)

    shared = build_sessions(DatasetSpec("shared-prefix", 6, input_len=10, prefix_len=30, num_groups=2), tok, rng)
    texts = [s.turns[0].text for s in shared]
    prefix = len(tok.decode(tok.encode(texts[0])[:20]))
    assert texts[0][:prefix] == texts[2][:prefix] != texts[1][:prefix]

    convs = build_sessions(DatasetSpec("conversation", 7, input_len=10, num_turns=3), tok, rng)
    assert [len(s.turns) for s in convs] == [3, 3, 1]
