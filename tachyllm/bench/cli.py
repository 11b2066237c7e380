"""`tachy bench {serve,throughput,latency,plot}`: argument parsing; the work is in serve.py,
offline.py and plot.py."""

from __future__ import annotations

import argparse
import os

from tachyllm.argtypes import non_negative_int, positive_float, positive_int
from tachyllm.bench.datasets import DATASETS
from tachyllm.bench.offline import cmd_bench_latency, cmd_bench_throughput
from tachyllm.bench.plot import cmd_bench_plot
from tachyllm.bench.serve import BACKENDS, PERCENTILE_METRICS, cmd_bench_serve, endpoint_kind
from tachyllm.engine_args import add_engine_args


def parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",")]
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0 (or inf), got {text}")
    return rates


def parse_concurrencies(text: str) -> list[int]:
    values = [int(part) for part in text.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1, got {text}")
    return values


def parse_percentiles(text: str) -> list[float]:
    values = [float(part) for part in text.split(",")]
    if any(not 0 < p < 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100), got {text}")
    return values


def parse_backend(text: str) -> str:
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an OpenAI-compatible backend; tachy bench serve takes vllm or openai (completions) "
            "and openai-chat (chat completions)"
        )
    return text


def parse_endpoint(text: str) -> str:
    try:
        return endpoint_kind(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_percentile_metrics(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in PERCENTILE_METRICS for name in names):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(PERCENTILE_METRICS)}, got {text!r}")
    return names


def add_workload_args(p: argparse.ArgumentParser, datasets: tuple[str, ...]) -> None:
    """The workload; vLLM's bench names (--dataset-name, --random-input-len, ...) are the same flags."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", default="random", choices=datasets)
    g.add_argument(
        "--dataset-path", default=None,
        help='--dataset file: JSONL, one {"prompt": str, "output_len": int} per line; sharegpt: a local ShareGPT JSON',
    )  # fmt: skip
    g.add_argument(
        "--num-prompts", type=positive_int, default=100, help="requests in all (conversation turns count one each)"
    )
    g.add_argument(
        "--input-len",
        "--random-input-len",
        type=positive_int,
        default=1024,
        help="prompt tokens (random; per turn or suffix for the others)",
    )
    g.add_argument(
        "--output-len", "--random-output-len", type=positive_int, default=128, help="max_tokens of each request"
    )
    g.add_argument(
        "--range-ratio", "--random-range-ratio", type=float, default=0.0,
        help="lengths drawn uniformly from [len*(1-r), len*(1+r)]",
    )  # fmt: skip


def add_serve_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (tachy, llama.cpp, vLLM, ...)")
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url", default=None,
        help="server root (a trailing /v1 is accepted) (default: http://HOST:PORT, http://127.0.0.1:8000)",
    )  # fmt: skip
    g.add_argument("--host", default="127.0.0.1", help="the server's host, without --base-url")
    g.add_argument("--port", type=positive_int, default=8000, help="the server's port, without --base-url")
    g.add_argument(
        "--endpoint", type=parse_endpoint, default=None, metavar="{completions,chat,embeddings}",
        help="the API: completions, chat or embeddings (one input per request: its latency and inputs/s), or its "
        "path (/v1/completions, /v1/chat/completions, /v1/embeddings) (default: --backend's, else completions)",
    )  # fmt: skip
    g.add_argument(
        "--backend", type=parse_backend, default=None, metavar="{vllm,openai,openai-chat}",
        help="vLLM's name for the API: vllm and openai send completions, openai-chat chat completions",
    )  # fmt: skip
    g.add_argument(
        "--model",
        default=None,
        help="model name to request (default: the server's first); also the tokenizer when it is a local path",
    )
    g.add_argument(
        "--served-model-name", default=None,
        help="the model name to request when it is not --model (then only the tokenizer's path)",
    )  # fmt: skip
    g.add_argument(
        "--lora-modules", nargs="+", default=None, metavar="NAME",
        help="a mix of models: each request (each conversation of a multi-turn dataset) names one of these "
        "LoRA adapters (or models) the server serves, drawn at random from --seed (vLLM's flag)",
    )  # fmt: skip
    g.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF file or HF directory to count tokens with (default: the model if a local path, else the default)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--timeout", type=positive_float, default=600.0, help="seconds one request may take before it counts as failed"
    )
    add_workload_args(p, DATASETS)
    g = p.add_argument_group("workload shapes")
    g.add_argument(
        "--prefix-len", type=positive_int, default=512, help="shared-prefix: tokens of each group's common prefix"
    )
    g.add_argument("--num-groups", type=positive_int, default=4, help="shared-prefix: number of distinct prefixes")
    g.add_argument("--num-turns", type=positive_int, default=3, help="conversation: user turns per session")
    g.add_argument(
        "--sharegpt-output-len", type=positive_int, default=None,
        help="sharegpt: max_tokens of every request (default: the length of each conversation's reply)",
    )  # fmt: skip
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[float("inf")],
        help="requests (sessions) per second; a comma list sweeps; inf = all at once",
    )
    g.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 = Poisson, <1 burstier, >1 steadier",
    )
    g.add_argument(
        "--max-concurrency",
        type=parse_concurrencies,
        default=None,
        help="requests in flight at most; a comma list sweeps (default: unlimited)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask for exactly --output-len tokens (vLLM's and llama.cpp's ignore_eos)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    g.add_argument("--warmup", type=non_negative_int, default=0, help="unmeasured random requests sent first")
    g = p.add_argument_group("report")
    g.add_argument(
        "--percentiles",
        "--metric-percentiles",
        type=parse_percentiles,
        default=[90.0, 99.0],
        help="comma list besides mean and median (default 90,99)",
    )
    g.add_argument(
        "--percentile-metrics", type=parse_percentile_metrics, default=list(PERCENTILE_METRICS),
        metavar="METRICS", help=f"the latencies the summary reports, comma list of {','.join(PERCENTILE_METRICS)} "
        "(default: all; the result file holds all)",
    )  # fmt: skip
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs a request must all meet to count: ttft:MS tpot:MS e2el:MS",
    )
    g.add_argument(
        "--cost-per-hour",
        type=positive_float,
        default=None,
        metavar="USD",
        help="machine price, for $ per 1M output tokens and per 1k requests",
    )
    g.add_argument("--result-json", default=None, metavar="FILE", help="write every figure and the settings here")
    g.add_argument(
        "--save-result", action="store_true",
        help="vLLM's spelling: write the result file, --result-filename in --result-dir "
        "(default name: BACKEND-RATEqps-MODEL-YYYYmmdd-HHMMSS.json)",
    )  # fmt: skip
    g.add_argument("--result-filename", default=None, metavar="FILE", help="with --save-result: its name")
    g.add_argument("--result-dir", default=None, metavar="DIR", help="with --save-result: its folder (default: .)")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="--result-json also holds every request's TTFT, ITLs, latency, lengths and error",
    )
    g.add_argument(
        "--plot", default=None, metavar="FILE.png", help="throughput vs TTFT/TPOT p99 over the sweep's points"
    )
    g.add_argument("--label", default=None, help="this run's name in plots (default: MODEL @ URL)")
    g.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no progress bar")
    g = p.add_argument_group("vLLM's flags that mean nothing here")
    g.add_argument("--trust-remote-code", action="store_true", help="accepted and ignored: tokenizers are local files")
    p.set_defaults(func=cmd_bench_serve)


def add_throughput_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput of LLM.generate on a whole workload")
    add_workload_args(p, ("random", "file"))
    p.add_argument("--result-json", default=None, metavar="FILE")
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)  # its --seed also seeds the prompts
    p.set_defaults(func=cmd_bench_throughput)


def add_latency_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="prefill and decode-step latency of one batch, and memory bandwidth")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--num-iters", type=positive_int, default=5, help="timed batches")
    p.add_argument("--num-iters-warmup", type=non_negative_int, default=1, help="untimed batches first")
    p.add_argument(
        "--bandwidth-gbs",
        type=positive_float,
        default=None,
        help="machine memory bandwidth in GB/s (default: measured with a large copy)",
    )
    p.add_argument("--result-json", default=None, metavar="FILE", help="settings and figures (and --profile's)")
    g = p.add_argument_group("profile")
    g.add_argument(
        "--profile",
        action="store_true",
        help="afterwards, profile decode steps of one more batch: time per step in matmuls, attention, "
        "other ops, sampling, scheduling, Python; top ops",
    )
    g.add_argument("--profile-steps", type=positive_int, default=10, help="decode steps under the profiler")
    g.add_argument(
        "--profile-warmup-steps", type=non_negative_int, default=5, help="decode steps run first, unprofiled"
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_bench_latency)


def add_plot_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw result files of `bench serve` on one throughput-latency chart")
    p.add_argument("results", nargs="+", metavar="RESULT.json")
    p.add_argument("--output", "-o", required=True, metavar="FILE.png")
    p.set_defaults(func=cmd_bench_plot)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server (serve) or the engine (throughput, latency)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    add_serve_bench_parser(sub)
    add_throughput_parser(sub)
    add_latency_parser(sub)
    add_plot_parser(sub)
