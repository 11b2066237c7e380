"""What request tracing costs a server: output tokens/s at --streams concurrent streaming requests, tracing
off vs on (--otlp-traces-endpoint, exporting over OTLP/HTTP to a receiver that decodes every export).

It also measures the CPU time tracing adds per request, which round-to-round noise on a shared machine
hides in the tok/s comparison: building a request's spans (a typical one: one engine request, its
scheduling, prefill-chunk and token events), exporting them and decoding them in the receiver.

Two servers of the same model live in this process (uvicorn threads), one with tracing; rounds alternate
which goes first, and only one runs at a time (an idle engine sleeps). The receiver runs in this process
too, so its decoding competes with the traced server: a pessimistic measure of the tracing cost.

    .venv/bin/python benchmarks/tracing_overhead_bench.py                  # the default model, 64 x 64 tokens
    .venv/bin/python benchmarks/tracing_overhead_bench.py --model PATH --rounds 5 --streams 64 --tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.server import thread_server  # noqa: E402
from otlp_receiver import http_receiver  # noqa: E402

from tachyllm.otel import RequestTracer, TracedRequest, TraceOptions  # noqa: E402
from tachyllm.outputs import CompletionOutput, RequestEvent, RequestMetrics, RequestOutput  # noqa: E402
from tachyllm.sampling_params import SamplingParams  # noqa: E402


async def one_round(url: str, streams: int, tokens: int) -> float:
    """Output tokens/s of `streams` concurrent streaming completions of `tokens` tokens each."""

    async def stream(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Request {i}: tell me a story about", "max_tokens": tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass
        return tokens

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        total = sum(await asyncio.gather(*(stream(client, i) for i in range(streams))))
        return total / (time.perf_counter() - start)


def span_cpu_seconds(endpoint: str, requests: int = 2000) -> float:
    """CPU seconds (this process: building, exporting, receiving) per traced request of 64 output tokens."""
    tracer = RequestTracer(TraceOptions(endpoint))
    params = SamplingParams(max_tokens=64)
    start_cpu = time.process_time()
    for i in range(requests):
        now = time.time()
        events = [RequestEvent("scheduled", now, {"sample": 0, "cached_tokens": 0}),
                  RequestEvent("prefill_chunk", now, {"sample": 0, "start": 0, "tokens": 12})]  # fmt: skip
        metrics = RequestMetrics(now, now, now + 0.01, now + 0.5, now + 0.5, 64, events=events)
        out = RequestOutput(f"r{i}", None, list(range(12)), [CompletionOutput(0, "", list(range(64)), "length")],
                            True, metrics)  # fmt: skip
        request = TracedRequest(now, "text_completion", "model", f"cmpl-{i}", [params], admitted_time=now)
        request.observe(out)
        tracer.finish(tracer.start(None, now), request, now + 0.5)
        if i % 100 == 99:  # a server's pace, not a burst the bounded queue would drop
            tracer.force_flush()
    assert tracer.dropped_spans == 0
    seconds = (time.process_time() - start_cpu) / requests
    tracer.shutdown()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--engine-flag", action="append", default=[], help="extra engine flags, e.g. --max-num-seqs=64")
    opts = parser.parse_args()
    base = ["--log-stats-interval", "0", "--disable-log-requests", "--uvicorn-log-level", "warning"]
    base += ([] if opts.model is None else ["--model", opts.model]) + ["--max-num-seqs", str(opts.streams)]
    base += opts.engine_flag
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    with http_receiver() as (receiver, endpoint):
        with thread_server(base) as (off, *_), thread_server([*base, "--otlp-traces-endpoint", endpoint]) as (on, *_):
            urls = {"off": off, "on": on}
            for url in urls.values():  # warm-up: first steps, allocator, kernels
                asyncio.run(one_round(url, 8, 8))
            results: dict[str, list[float]] = {"off": [], "on": []}
            for r in range(opts.rounds):
                for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    rate = asyncio.run(one_round(urls[mode], opts.streams, opts.tokens))
                    results[mode].append(rate)
                    print(f"round {r} tracing {mode:3}: {rate:8.1f} output tok/s (load {os.getloadavg()[0]:.1f})")
        spans = len(receiver.spans)  # the servers' tracers exported what they held as they stopped
        per_request = span_cpu_seconds(endpoint)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"median: off {off:.1f}, on {on:.1f} output tok/s: tracing costs {100 * (1 - on / off):+.1f}%")
    print(f"spans received: {spans}")
    print(f"tracing CPU time per request (spans built, exported and received): {per_request * 1e6:.0f} us")


if __name__ == "__main__":
    main()
