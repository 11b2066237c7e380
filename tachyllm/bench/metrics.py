"""The arithmetic of `tachy bench serve`, with vLLM's definitions, on client-side timestamps.

TTFT: request sent -> first chunk with content. TPOT per request: (E2EL - TTFT) / (output tokens - 1).
ITL: every gap between consecutive content chunks, pooled over requests (a chunk may carry several
tokens; its gap is still one ITL sample, as in vLLM). E2EL: request sent -> stream finished.
All times are in seconds here and in milliseconds in the reported distributions.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What the client saw of one request (time.perf_counter() seconds)."""

    prompt_len: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried content
    end: float = 0.0
    output_len: int = 0  # generated tokens: the server's usage, else the re-tokenized text
    text: str = ""
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """None for a one-token output, which has no time per output token."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def distribution(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean, median and the asked percentiles, in ms; empty when there is nothing to summarize."""
    if not values:
        return {}
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    out = {"mean": float(ms.mean()), "median": float(np.median(ms))}
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(ms, p))
    return out


def percentile_key(p: float) -> str:
    return f"p{p:g}"


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A one-token request has TPOT 0 here (nothing after the first token to be slow), as in vLLM."""
    observed = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(observed[key] * 1000.0 <= limit for key, limit in slos_ms.items())


def peak_output_throughput(results: list[RequestResult], duration: float, window: float = 1.0) -> float:
    """Most output tokens/s in any `window` seconds of the run (a sliding window, so a burst is not
    split across two fixed buckets); a run shorter than the window is one window as long as the run.
    A chunk carries its request's output tokens shared evenly over its chunks (servers usually send
    one token per chunk)."""
    window = min(window, duration)
    if window <= 0:
        return 0.0
    events = sorted(
        (t, r.output_len / len(r.chunk_times)) for r in results if r.success and r.chunk_times for t in r.chunk_times
    )
    best = in_window = 0.0
    first = 0
    for t, tokens in events:
        in_window += tokens
        while events[first][0] <= t - window:  # keep the events of (t - window, t]
            in_window -= events[first][1]
            first += 1
        best = max(best, in_window)
    return best / window


@dataclass
class Cost:
    usd_per_hour: float
    usd_per_million_output_tokens: float | None
    usd_per_1k_requests: float | None


def cost(usd_per_hour: float, output_throughput: float, request_throughput: float) -> Cost:
    """What the measured throughput costs on a machine rented at `usd_per_hour`."""
    per_second = usd_per_hour / 3600.0
    return Cost(
        usd_per_hour,
        per_second / output_throughput * 1e6 if output_throughput > 0 else None,
        per_second / request_throughput * 1e3 if request_throughput > 0 else None,
    )


@dataclass
class BenchMetrics:
    completed: int
    failed: int
    errors: dict[str, int]  # error message -> how many requests failed with it
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    slos_ms: dict[str, float]
    good_requests: int | None  # None without SLOs
    goodput: float | None  # requests/s meeting every SLO
    cost: Cost | None


def compute_metrics(
    results: list[RequestResult],
    start: float,
    end: float,
    percentiles: list[float],
    slos_ms: dict[str, float] | None = None,
    usd_per_hour: float | None = None,
) -> BenchMetrics:
    """Throughputs count completed requests only and divide by the wall time of the whole run."""
    done = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    duration = max(end - start, 1e-9)
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    request_tput, output_tput = len(done) / duration, output_tokens / duration
    good = sum(meets_slos(r, slos_ms) for r in done) if slos_ms else None
    return BenchMetrics(
        completed=len(done),
        failed=len(failed),
        errors=dict(Counter(r.error or "" for r in failed)),  # a failed result has its error
        duration_s=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=request_tput,
        output_throughput=output_tput,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        peak_output_throughput=peak_output_throughput(done, duration),
        ttft_ms=distribution([r.ttft for r in done], percentiles),
        tpot_ms=distribution([t for r in done if (t := r.tpot) is not None], percentiles),
        itl_ms=distribution([gap for r in done for gap in r.itls], percentiles),
        e2el_ms=distribution([r.latency for r in done], percentiles),
        slos_ms=dict(slos_ms or {}),
        good_requests=good,
        goodput=None if good is None else good / duration,
        cost=None if usd_per_hour is None else cost(usd_per_hour, output_tput, request_tput),
    )


# -- server-side counters (/metrics) -------------------------------------------------------------

# One series: (metric name without prefix or _total, its position label, its other labels, sorted).
CounterKey = tuple[str, str | None, tuple[tuple[str, str], ...]]


@dataclass
class SpecDecodeStats:
    drafts: float
    draft_tokens: float
    accepted_tokens: float
    acceptance_rate: float | None  # accepted / drafted tokens
    mean_acceptance_length: float | None  # tokens per step: 1 (the target's own) + accepted per draft
    acceptance_per_position: list[float]  # share of drafts whose token at position i was accepted


@dataclass
class ServerStats:
    prefix_cache_queries: float | None
    prefix_cache_hits: float | None
    prefix_cache_hit_rate: float | None
    spec_decode: SpecDecodeStats | None


def server_stats(before: dict[CounterKey, float], after: dict[CounterKey, float]) -> ServerStats:
    """Counter increases over the run, summed over series (replicas, say); a counter the server does not
    export stays None. Per series, as Prometheus's increase(): a series that appeared during the run (a
    new replica) or went back (a restarted server) counts from 0, and one that disappeared (a replica
    gone, whose last figures a scale-out ingress may still show at the first scrape) counts nothing."""

    def delta(name: str, position: str | None = None) -> float | None:
        series = [key for key in after if key[:2] == (name, position)]
        if not series:
            return None
        return sum(after[k] - before[k] if before.get(k, math.inf) <= after[k] else after[k] for k in series)

    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    hit_rate = hits / queries if queries and hits is not None else None
    spec = None
    drafts, draft_tokens = delta("spec_decode_num_drafts"), delta("spec_decode_num_draft_tokens")
    accepted = delta("spec_decode_num_accepted_tokens")
    if drafts is not None and draft_tokens is not None and accepted is not None:
        positions = sorted(
            {pos for name, pos, _ in after if name == "spec_decode_num_accepted_tokens_per_pos" and pos is not None},
            key=int,
        )
        per_pos = [delta("spec_decode_num_accepted_tokens_per_pos", pos) or 0.0 for pos in positions]
        per_position = [a / drafts if drafts else 0.0 for a in per_pos]
        spec = SpecDecodeStats(
            drafts,
            draft_tokens,
            accepted,
            accepted / draft_tokens if draft_tokens else None,
            1.0 + accepted / drafts if drafts else None,
            per_position,
        )
    return ServerStats(queries, hits, hit_rate, spec)
