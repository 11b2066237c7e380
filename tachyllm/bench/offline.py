"""`tachy bench throughput` and `tachy bench latency`: the engine in-process, no HTTP.

throughput: a whole workload through LLM.generate; requests/s and tokens/s over the wall time.
latency: one batch of fixed size driven step by step; prefill and decode-step times, and the memory
bandwidth a decode step achieves (it streams every weight once) against what this machine can do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tachyllm import LLM, SamplingParams
from tachyllm.bench.datasets import random_token_ids, read_prompt_file, sample_lengths
from tachyllm.bench.profile import format_profile, profile_decode
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.llm import Prompt
from tachyllm.outputs import RequestOutput
from tachyllm.sampling_params import RequestOutputKind


def make_llm(args: argparse.Namespace) -> LLM:
    config = engine_config(args)
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model"}
    return LLM(config.model, **options)


def peak_rss_mib() -> float:
    """Peak resident memory of this process; ru_maxrss is KiB on Linux and bytes on macOS."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {path}")


# -- throughput ----------------------------------------------------------------------------------


@dataclass
class ThroughputResult:
    num_requests: int
    failed: int
    elapsed_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_rss_mib: float


def throughput_prompts(args: argparse.Namespace, llm: LLM) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; random ids give exact lengths, unlike text."""
    tokenizer = llm.get_tokenizer()
    if args.dataset == "file":
        turns = read_prompt_file(args.dataset_path, args.output_len, args.num_prompts)
        return [(llm.engine.input_processor.encode(t.text), t.output_len) for t in turns]
    rng = np.random.default_rng(args.seed)
    inputs = sample_lengths(args.input_len, args.range_ratio, args.num_prompts, rng)
    outputs = sample_lengths(args.output_len, args.range_ratio, args.num_prompts, rng)
    return [(random_token_ids(tokenizer, i, rng), o) for i, o in zip(inputs, outputs)]


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    work = throughput_prompts(args, llm)
    prompts: list[Prompt] = [{"prompt_token_ids": ids} for ids, _ in work]
    # ignore_eos: every request produces exactly the asked-for tokens, so runs are comparable.
    params = [SamplingParams(temperature=1.0, max_tokens=out, ignore_eos=True) for _, out in work]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    done = [o for o in outputs if o.error is None]
    input_tokens = sum(len(o.prompt_token_ids) for o in done)
    output_tokens = sum(len(c.token_ids) for o in done for c in o.outputs)
    result = ThroughputResult(
        num_requests=len(done),
        failed=len(outputs) - len(done),
        elapsed_s=elapsed,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / elapsed,
        output_throughput=output_tokens / elapsed,
        total_token_throughput=(input_tokens + output_tokens) / elapsed,
        peak_rss_mib=peak_rss_mib(),
    )
    print(
        f"Throughput: {result.request_throughput:.2f} requests/s, {result.total_token_throughput:.2f} total tokens/s, "
        f"{result.output_throughput:.2f} output tokens/s ({len(done)} requests in {elapsed:.2f} s"
        f"{f', {result.failed} failed' if result.failed else ''}); peak memory {result.peak_rss_mib:.0f} MiB"
    )
    write_json(args.result_json, {"settings": run_settings(args), "result": dataclasses.asdict(result)})
    return 0


# -- latency -------------------------------------------------------------------------------------


@dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_ms: dict[str, float]  # median / p99 over iterations, of the steps until every request has a token
    decode_step_ms: dict[str, float]  # median / p99 over every later step of every iteration
    decode_steps_per_s: float
    weight_bytes: int
    achieved_bandwidth_gbs: float  # weight bytes x decode steps/s
    machine_bandwidth_gbs: float
    bandwidth_source: str  # "measured" or "given"
    bandwidth_utilization: float


def median_p99(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1000.0
    return {"median": float(np.median(ms)), "p99": float(np.percentile(ms, 99))}


def measure_bandwidth_gbs(device: torch.device, size_bytes: int = 256 << 20, repeats: int = 10) -> float:
    """Copy bandwidth of one large tensor, counting each copy's read and write. The tensor is far
    larger than any cache, so this is main-memory (or HBM) speed, the ceiling a decode step can reach."""
    src = torch.empty(size_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * size_bytes / statistics.median(times) / 1e9


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_one_batch(llm: LLM, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, list[float]]:
    """Runs the batch to the end; returns the prefill time and each decode step's time."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    # A long batch may prefill in several chunks: prefill lasts until every request has its first token.
    started: set[str] = set()
    prefill, decode = 0.0, []
    while engine.has_unfinished_requests():
        synchronize(engine.device)
        t0 = time.perf_counter()
        outputs = engine.step()
        synchronize(engine.device)
        elapsed = time.perf_counter() - t0
        if len(started) < len(prompts):
            prefill += elapsed
            started.update(
                o.request_id for o in outputs if isinstance(o, RequestOutput) and o.outputs and o.outputs[0].token_ids
            )
        else:
            decode.append(elapsed)
    return prefill, decode


def cmd_bench_latency(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    rng = np.random.default_rng(args.seed)
    prompts = [random_token_ids(llm.get_tokenizer(), args.input_len, rng) for _ in range(args.batch_size)]
    for i in range(args.num_iters_warmup):
        time_one_batch(llm, prompts, args.output_len, f"warmup{i}")
    prefills, steps = [], []
    for i in range(args.num_iters):
        # Prefix caching would turn later iterations' prefill into cache hits; fresh prompts each time.
        batch = [random_token_ids(llm.get_tokenizer(), args.input_len, rng) for _ in range(args.batch_size)]
        prefill, decode = time_one_batch(llm, batch, args.output_len, f"iter{i}")
        prefills.append(prefill)
        steps.extend(decode)
    if not steps:
        raise ValueError("no decode steps were timed: use --output-len of 2 or more")
    weight_bytes = llm.engine.weight_bytes
    steps_per_s = 1.0 / statistics.median(steps)
    achieved = weight_bytes * steps_per_s / 1e9
    machine = args.bandwidth_gbs or measure_bandwidth_gbs(llm.engine.device)
    result = LatencyResult(
        batch_size=args.batch_size,
        input_len=args.input_len,
        output_len=args.output_len,
        prefill_ms=median_p99(prefills),
        decode_step_ms=median_p99(steps),
        decode_steps_per_s=steps_per_s,
        weight_bytes=weight_bytes,
        achieved_bandwidth_gbs=achieved,
        machine_bandwidth_gbs=machine,
        bandwidth_source="given" if args.bandwidth_gbs else "measured",
        bandwidth_utilization=achieved / machine,
    )
    print(
        f"Batch {args.batch_size} x {args.input_len} in / {args.output_len} out, {args.num_iters} iterations\n"
        f"  prefill      median {result.prefill_ms['median']:9.2f} ms   p99 {result.prefill_ms['p99']:9.2f} ms\n"
        f"  decode step  median {result.decode_step_ms['median']:9.2f} ms   p99 {result.decode_step_ms['p99']:9.2f} ms"
        f"   ({steps_per_s:.1f} steps/s)\n"
        f"  bandwidth    {achieved:.1f} GB/s achieved ({weight_bytes / 1e6:.1f} MB of weights per step) of "
        f"{machine:.1f} GB/s {result.bandwidth_source} = {100 * result.bandwidth_utilization:.1f}%"
    )
    document = {"settings": run_settings(args), "result": dataclasses.asdict(result)}
    if getattr(args, "profile", False):
        # A fresh batch of the same shape, so the profiled steps decode what the timed ones did.
        batch = [random_token_ids(llm.get_tokenizer(), args.input_len, rng) for _ in range(args.batch_size)]
        profiled = profile_decode(llm.engine, batch, args.profile_steps, args.profile_warmup_steps)
        print(format_profile(profiled))
        document["profile"] = dataclasses.asdict(profiled)
    write_json(args.result_json, document)
    return 0


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("func", "command", "bench_command")}
