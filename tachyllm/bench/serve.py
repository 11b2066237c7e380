"""`tachy bench serve`: drive an OpenAI-compatible server with a workload at a given request rate and
concurrency, then report latency distributions, throughput, goodput, cost and server-side cache stats.

Each point of a sweep (--request-rate 1,2,inf and/or --max-concurrency 1,8) draws fresh prompts from
its own seed, so a server with prefix caching does not find a later point's prompts already cached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tachyllm.bench.client import ENDPOINTS, BenchClient, Endpoint, Prompt, root_url
from tachyllm.bench.datasets import DatasetSpec, Session, build_sessions
from tachyllm.bench.metrics import (
    SLO_KEYS,
    BenchMetrics,
    RequestResult,
    ServerStats,
    compute_metrics,
    percentile_key,
    server_stats,
)
from tachyllm.engine.input_processor import chat_prompt_ids
from tachyllm.errors import TachyError
from tachyllm.loading import Tokenizer, load_checkpoint


@dataclass
class SentRequest:
    prompt: Prompt
    result: RequestResult


@dataclass
class PointResult:
    """One point of a sweep: its load settings and what was measured."""

    request_rate: float
    max_concurrency: int | None
    seed: int
    metrics: BenchMetrics
    server: ServerStats | None
    # --save-detailed: every request's figures, in seconds and in completion order (vLLM's field names).
    detailed: dict[str, list] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["request_rate"] = json_rate(self.request_rate)
        return out


def detailed_results(results: list[RequestResult]) -> dict[str, list]:
    """Per-request figures for analysis beyond the summary (pooling percentiles over runs, say); a failed
    request has no TTFT, ITLs or latency (None) and its error."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft if r.success else None for r in results],
        "itls": [r.itls if r.success else None for r in results],
        "latencies": [r.latency if r.success else None for r in results],
        "errors": [r.error for r in results],
    }


def json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


# -- argument parsing ----------------------------------------------------------------------------

# vLLM's --backend names for the two APIs this client speaks.
BACKENDS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def endpoint_kind(text: str) -> str:
    """--endpoint: a kind (completions, chat) or its path as vLLM's bench takes it (/v1/completions)."""
    by_path = {path: kind for kind, path in ENDPOINTS.items()}
    if text in ENDPOINTS or text in by_path:
        return by_path.get(text, text)
    raise ValueError(f"unknown endpoint {text!r}; choose from {', '.join([*ENDPOINTS, *by_path])}")


def apply_vllm_flags(args: argparse.Namespace) -> None:
    """vLLM's bench flags on this command's own: --host/--port as the --base-url, --backend as the
    --endpoint, --served-model-name as the model requested, --save-result as a --result-json file."""
    args.base_url = args.base_url or f"http://{args.host}:{args.port}"
    from_backend = BACKENDS[args.backend] if args.backend else None
    if from_backend and args.endpoint and args.endpoint != from_backend:
        raise ValueError(
            f"--backend {args.backend} sends {from_backend} requests, not to --endpoint {ENDPOINTS[args.endpoint]}"
        )
    args.endpoint = args.endpoint or from_backend or "completions"
    if args.endpoint == "embeddings":
        # An embedding is answered whole: its latency is the only one (the result file has them all).
        args.percentile_metrics = ["e2el"]
    if args.served_model_name:
        args.tokenizer = args.tokenizer or args.model  # --model then names the tokenizer only, as in vLLM
        args.model = args.served_model_name
    if args.save_result or args.result_filename:
        if args.result_json:
            raise ValueError("give the result file once: --result-json, or --save-result with --result-filename")
        rate = "+".join(str(json_rate(r)) for r in args.request_rate)
        model = Path(args.model).name if args.model else "model"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = args.result_filename or f"{args.backend or 'vllm'}-{rate}qps-{model}-{stamp}.json"
        args.result_json = str(Path(args.result_dir or ".") / name)


def parse_slos(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        slos[key] = float(value)
    return slos


def load_tokenizer(tokenizer: str | None, model: str | None) -> Tokenizer:
    """--tokenizer, else the model (--model, or the first the server lists) when it names a local
    checkpoint, else the default model's."""
    path = tokenizer or (model if model and Path(model).exists() else None)
    return load_checkpoint(path).tokenizer


# -- the load ------------------------------------------------------------------------------------


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Seconds from the start at which each session begins: gamma-distributed gaps with mean
    1/rate (shape 1 = Poisson arrivals; smaller shapes are burstier), or all at once for rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


def prompt_length(tokenizer: Tokenizer, prompt: Prompt) -> int:
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt))
    try:
        return len(chat_prompt_ids(tokenizer, prompt))
    except TachyError:  # no usable chat template: count the message texts alone
        return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in prompt)


async def run_load(
    client: BenchClient,
    models: list[str],
    sessions: list[Session],
    offsets: list[float],
    max_concurrency: int | None,
    progress: bool,
) -> tuple[list[SentRequest], float, float]:
    """Sends every session's turns, each session's to its model of `models` (one per session); returns the
    requests in completion order and the run's start/end."""
    slots = asyncio.Semaphore(max_concurrency or sys.maxsize)
    chat = client.endpoint.kind == "chat"
    sent: list[SentRequest] = []
    bar = tqdm(total=sum(len(s.turns) for s in sessions), desc="requests", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()

    async def run_session(session: Session, model: str, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        messages: list[dict[str, str]] = []
        text = ""
        for k, turn in enumerate(session.turns):
            # Later turns resend the whole conversation, with the replies the server actually gave.
            messages.append({"role": "user", "content": turn.text})
            text += turn.text
            prompt: Prompt = list(messages) if chat else text
            async with slots:  # a slot per request: a session between turns holds none
                result = await client.send(model, prompt, turn.output_len)
            sent.append(SentRequest(prompt, result))
            bar.update(1)
            if not result.success:
                for _ in session.turns[k + 1 :]:  # the conversation cannot go on; count what was lost
                    sent.append(
                        SentRequest(prompt, RequestResult(0, error="not sent: an earlier turn of its session failed"))
                    )
                    bar.update(1)
                return
            messages.append({"role": "assistant", "content": result.text})
            text += result.text

    try:
        await asyncio.gather(*(run_session(s, m, at) for s, m, at in zip(sessions, models, offsets)))
    finally:
        bar.close()
    return sent, start, time.perf_counter()


def count_tokens(sent: list[SentRequest], tokenizer: Tokenizer) -> list[RequestResult]:
    """Prompt lengths from the tokenizer; output lengths from the tokenizer only where the server
    sent no usage. Done after the run, so tokenizing never delays a request."""
    for s in sent:
        s.result.prompt_len = prompt_length(tokenizer, s.prompt)
        if s.result.success and s.result.output_len == 0:
            s.result.output_len = len(tokenizer.encode(s.result.text, add_special_tokens=False))
    return [s.result for s in sent]


def make_endpoint(args: argparse.Namespace) -> Endpoint:
    return Endpoint(args.base_url, args.endpoint, args.model, args.api_key, args.ignore_eos, args.timeout)


async def check_server(args: argparse.Namespace) -> str:
    """The model benchmarked (--model, or the first the server lists), asked before the tokenizer loads and
    the workload is built: a server that is down is told in one line."""
    async with contextlib.aclosing(BenchClient(make_endpoint(args), 1)) as client:
        await client.check_reachable()
        return await client.model_name()


def session_models(args: argparse.Namespace, model: str, count: int, rng: np.random.Generator) -> list[str]:
    """The model each session requests: `model`, or with --lora-modules one of those names drawn at
    random (from the run's seed) per session, as vLLM's benchmark picks a LoRA module per request."""
    if not args.lora_modules:
        return [model] * count
    return [args.lora_modules[i] for i in rng.integers(len(args.lora_modules), size=count)]


async def check_lora_modules(client: BenchClient, names: list[str]) -> None:
    """Every --lora-modules name must be a model the server lists: a typo would fail every request it drew."""
    served = await client.served_models()
    if missing := [n for n in names if n not in served]:
        raise TachyError(
            f"--lora-modules: {', '.join(map(repr, missing))} not served at {root_url(client.endpoint.base_url)} "
            f"(it serves {', '.join(served)})"
        )


async def run_sweep(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[str, list[PointResult]]:
    endpoint = make_endpoint(args)
    concurrencies: list[int | None] = list(args.max_concurrency or [None])
    spec = DatasetSpec(
        kind=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_groups=args.num_groups,
        num_turns=args.num_turns,
        path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
    )
    slos = parse_slos(args.goodput)
    points: list[PointResult] = []
    max_connections = max(c or args.num_prompts for c in concurrencies)
    async with contextlib.aclosing(BenchClient(endpoint, max_connections)) as client:
        model = await client.model_name()
        if args.lora_modules:
            await check_lora_modules(client, args.lora_modules)
        if args.warmup:
            # Random prompts from a seed no measured point uses, so they warm nothing in a prefix cache.
            warm = DatasetSpec("random", args.warmup, args.input_len, args.output_len)
            sessions = build_sessions(warm, tokenizer, np.random.default_rng((args.seed, 1)))
            models = session_models(args, model, len(sessions), np.random.default_rng((args.seed, 1, 1)))
            await run_load(client, models, sessions, [0.0] * len(sessions), concurrencies[0], progress=False)
        for index, (rate, concurrency) in enumerate((r, c) for r in args.request_rate for c in concurrencies):
            rng = np.random.default_rng((args.seed, 0, index))
            sessions = build_sessions(spec, tokenizer, rng)
            offsets = arrival_offsets(len(sessions), rate, args.burstiness, rng)
            models = session_models(args, model, len(sessions), np.random.default_rng((args.seed, 2, index)))
            before = await client.scrape()
            sent, start, end = await run_load(client, models, sessions, offsets, concurrency, not args.no_progress)
            after = await client.scrape() if before is not None else None
            results = count_tokens(sent, tokenizer)
            metrics = compute_metrics(results, start, end, args.percentiles, slos or None, args.cost_per_hour)
            stats = server_stats(before, after) if before is not None and after is not None else None
            detailed = detailed_results(results) if args.save_detailed else None
            point = PointResult(rate, concurrency, args.seed, metrics, stats, detailed)
            url = f"{root_url(args.base_url)}{ENDPOINTS[args.endpoint]}"
            print(format_summary(point, url, model, args.percentiles, args.percentile_metrics))
            points.append(point)
    return model, points


# -- reporting -----------------------------------------------------------------------------------

WIDTH = 60


def format_summary(
    point: PointResult,
    url: str,
    model: str,
    percentiles: list[float],
    latencies: tuple[str, ...] | list[str] = PERCENTILE_METRICS,
) -> str:
    """`latencies`: which of PERCENTILE_METRICS get a section."""
    m = point.metrics
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>{WIDTH - 44}}")

    def section(title: str) -> None:
        lines.append(f" {title} ".center(WIDTH, "-"))

    lines.append(f"{'Endpoint:':<20}{url:>{WIDTH - 20}}")
    row("Model:", model)
    row("Request rate (req/s):", "inf" if math.isinf(point.request_rate) else point.request_rate)
    row("Max concurrency:", point.max_concurrency or "unlimited")
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if url.endswith(ENDPOINTS["embeddings"]):  # one input per request
        row("Input throughput (inputs/s):", m.request_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Peak output token throughput (tok/s):", m.peak_output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    if m.goodput is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in m.slos_ms.items())
        row(f"Goodput (req/s) [{slos} ms]:", m.goodput)
    if m.cost is not None:
        if m.cost.usd_per_million_output_tokens is not None:
            row(
                f"Cost at ${m.cost.usd_per_hour:g}/h ($/1M output tokens):",
                f"{m.cost.usd_per_million_output_tokens:.4f}",
            )
        if m.cost.usd_per_1k_requests is not None:
            row(f"Cost at ${m.cost.usd_per_hour:g}/h ($/1k requests):", f"{m.cost.usd_per_1k_requests:.4f}")
    keys = ["mean", "median", *(percentile_key(p) for p in percentiles)]
    for title, short, dist in (
        ("Time to First Token", "TTFT", m.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
        ("Inter-token Latency", "ITL", m.itl_ms),
        ("End-to-end Latency", "E2EL", m.e2el_ms),
    ):
        if short.lower() not in latencies:
            continue
        section(title)
        for key in keys:
            row(f"{key.capitalize() if key in ('mean', 'median') else key.upper()} {short} (ms):", dist.get(key, "-"))
    s = point.server
    if s is not None and (s.prefix_cache_hit_rate is not None or s.spec_decode is not None):
        section("Server (/metrics, this run)")
        if s.prefix_cache_hit_rate is not None:
            row("Prefix cache hit rate (%):", 100.0 * s.prefix_cache_hit_rate)
        if s.spec_decode is not None:
            sd = s.spec_decode
            row("Spec decode drafts:", int(sd.drafts))
            row("Spec decode acceptance rate (%):", "-" if sd.acceptance_rate is None else 100.0 * sd.acceptance_rate)
            row(
                "Spec decode mean acceptance length:",
                "-" if sd.mean_acceptance_length is None else sd.mean_acceptance_length,
            )
            for pos, rate in enumerate(sd.acceptance_per_position):
                row(f"  accepted at position {pos} (%):", 100.0 * rate)
    lines.append("=" * WIDTH)
    if m.errors:
        lines.append("Errors:")
        lines.extend(f"  {count} x {message}" for message, count in sorted(m.errors.items(), key=lambda e: -e[1]))
    return "\n".join(lines)


def settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The run's settings as given (the API key left out), plus the model the server answered as."""
    out = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "bench_command", "command")}
    out["request_rate"] = [json_rate(r) for r in args.request_rate]
    out["served_model"] = model
    out["api_key_sent"] = args.api_key is not None
    out["label"] = args.label or f"{model} @ {root_url(args.base_url)}"
    return out


def cmd_bench_serve(args: argparse.Namespace) -> int:
    apply_vllm_flags(args)
    if args.save_detailed and not args.result_json:
        raise ValueError("--save-detailed writes into the --result-json file: give one")
    tokenizer = load_tokenizer(args.tokenizer, asyncio.run(check_server(args)))
    model, points = asyncio.run(run_sweep(args, tokenizer))
    result = {"settings": settings(args, model), "runs": [p.to_json() for p in points]}
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {args.result_json}")
    if args.plot:
        from tachyllm.bench.plot import plot_results  # matplotlib loads only when asked for

        plot_results([result], args.plot)
        print(f"plot written to {args.plot}")
    if failed := [p for p in points if p.metrics.completed == 0]:
        # Nothing was measured: a script or CI job must not take the run for a result.
        where = ", ".join(
            f"rate {json_rate(p.request_rate)} concurrency {p.max_concurrency or 'unlimited'}" for p in failed
        )
        print(f"tachy bench serve: error: every request failed ({where}); see Errors above", file=sys.stderr)
        return 1
    return 0
