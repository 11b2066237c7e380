"""Routing on Ray Serve, side by side in one run: tachyllm's precise prefix-cache router vs
Ray Serve's default (power of two choices) vs round robin, 2 replicas of the default model (SmolLM2-135M
Q4_1), one thread each, plus one replica alone for the hit rate a single cache reaches on the same work.

Workloads, each measured with the unchanged `tachy bench serve` against the Ray Serve ingress:
  conversation   multi-turn chats whose every turn resends the growing history (chat endpoint)
  long-conversation  the same with longer turns and histories (up to ~1,300 tokens)
  shared-prefix  many users sharing a few long system prompts (completions endpoint)
Every (router, workload) run starts on freshly deployed replicas (cold caches). Rounds alternate the
router order. Reported per run: prefix-cache hit rate (the replicas' own counters), TTFT p50/p99,
output throughput; then ranges over rounds and the ratios that judge a router (hit rate vs one replica,
TTFT p99 of the default router vs the prefix router, by round and over all rounds' requests pooled).

    .venv/bin/python benchmarks/ray_routing_bench.py                 # ~55 min on 2 cores
    .venv/bin/python benchmarks/ray_routing_bench.py --rounds 1 --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import ray
from ray import serve

from tachyllm.ray_serve.app import application
from tachyllm.ray_serve.config import RouterConfig, parse_config
from tachyllm.server.options import server_args

PORT = 8401
# fp32: on the 2-core AVX2 machine of the first runs one thread prefilled a long prompt faster in fp32 than in
# bf16; kept so that later runs compare with those.
ENGINE = {"dtype": "float32", "max_num_seqs": 32, "kv_cache_memory": "256M"}
# Enough requests that p99 is a percentile and not the slowest request of the run: 128-144 per run, at
# the same arrival rates as 32-48 (the load on the replicas is the same, the run is longer).
WORKLOADS = {
    "conversation": [
        "--endpoint", "chat", "--dataset", "conversation", "--num-prompts", "128", "--num-turns", "4",
        "--input-len", "96", "--output-len", "16", "--request-rate", "0.3",
    ],
    # Longer histories: a turn sent to a replica without them recomputes up to ~1,300 tokens.
    "long-conversation": [
        "--endpoint", "chat", "--dataset", "conversation", "--num-prompts", "144", "--num-turns", "6",
        "--input-len", "200", "--output-len", "16", "--request-rate", "0.2",
    ],
    "shared-prefix": [
        "--dataset", "shared-prefix", "--num-prompts", "144", "--num-groups", "4", "--prefix-len", "384",
        "--input-len", "32", "--output-len", "16", "--request-rate", "1.5",
    ],
}  # fmt: skip
QUICK = {
    "conversation": ["--num-prompts", "32"],
    "long-conversation": ["--num-prompts", "36"],
    "shared-prefix": ["--num-prompts", "48"],
}
MARGIN = RouterConfig.load_margin  # the default
SETUPS = {  # name: (router policy, replicas, load margin)
    "prefix": ("prefix", 2, MARGIN),
    # A tighter load guard: spreads a hot prompt to the other replica sooner (not in the default setups).
    "prefix_margin2": ("prefix", 2, 2),
    "power_of_two": ("power_of_two", 2, MARGIN),
    "round_robin": ("round_robin", 2, MARGIN),
    "one_replica": ("prefix", 1, MARGIN),
}
DEFAULT_SETUPS = ("prefix", "power_of_two", "round_robin", "one_replica")


def deploy(policy: str, replicas: int, load_margin: int) -> None:
    """A fresh application (cold caches), each replica warmed up by a few unrelated short requests (a
    replica's first requests are slower)."""
    config = parse_config(
        {
            "models": [{"name": "smollm", "replicas": replicas, "threads_per_replica": 1, "engine": ENGINE}],
            "router": {"policy": policy, "load_margin": load_margin},
        }
    )
    serve.run(application(config, server_args({"log_stats_interval": 0})), name="bench", route_prefix="/")

    async def warm_up() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=300) as client:
            body = {"model": "smollm", "max_tokens": 4}
            await asyncio.gather(
                *(client.post("/v1/completions", json={**body, "prompt": f"{i} warm"}) for i in range(8))
            )

    asyncio.run(warm_up())


def bench(workload: str, quick: bool, seed: int, out: Path) -> dict:
    command = [
        sys.executable, "-m", "tachyllm.entrypoints.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}",
        "--model", "smollm", "--ignore-eos", "--no-progress", "--result-json", str(out), "--save-detailed",
        "--seed", str(seed),
        *WORKLOADS[workload], *(QUICK[workload] if quick else []),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summary(result: dict) -> dict:
    run = result["runs"][0]
    m, server = run["metrics"], run["server"] or {}
    return {
        "hit_rate": server.get("prefix_cache_hit_rate"),
        "ttft_p50_ms": m["ttft_ms"]["median"],
        "ttft_p99_ms": m["ttft_ms"]["p99"],
        "output_tok_s": m["output_throughput"],
        "failed": m["failed"],
        "ttfts_s": [t for t in run["detailed"]["ttfts"] if t is not None],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer requests per run")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--setups", default=",".join(DEFAULT_SETUPS), help=f"routers to compare, of {', '.join(SETUPS)}"
    )
    parser.add_argument("--json", default=None, help="write every run's figures here")
    args = parser.parse_args()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    runs: list[dict] = []
    order = args.setups.split(",")
    if unknown := set(order) - set(SETUPS):
        parser.error(f"unknown setups {sorted(unknown)}; choose from {', '.join(SETUPS)}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_ in range(args.rounds):
                for workload in args.workloads.split(","):
                    for setup in order if round_ % 2 == 0 else order[::-1]:
                        deploy(*SETUPS[setup])
                        t0 = time.time()
                        # Each round its own prompts; within a round every setup gets the same ones.
                        raw = bench(workload, args.quick, round_ + 1, Path(tmp) / "result.json")
                        row = {"round": round_, "workload": workload, "setup": setup, **summary(raw)}
                        row["wall_s"] = round(time.time() - t0, 1)
                        runs.append(row)
                        print(json.dumps({k: v for k, v in row.items() if k != "ttfts_s"}), flush=True)
                        serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    report(runs)
    return 0


def report(runs: list[dict]) -> None:
    def values(workload: str, setup: str, key: str) -> list[float]:
        return [r[key] for r in runs if r["workload"] == workload and r["setup"] == setup and r[key] is not None]

    def span(xs: list[float], scale: float = 1.0, digits: int = 0) -> str:
        if not xs:
            return "-"
        lo, hi = min(xs) * scale, max(xs) * scale
        return f"{lo:.{digits}f}" if len(xs) == 1 or lo == hi else f"{lo:.{digits}f}-{hi:.{digits}f}"

    print("\n| workload | setup | hit rate % | TTFT p50 ms | TTFT p99 ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    for workload in dict.fromkeys(r["workload"] for r in runs):
        for setup in dict.fromkeys(r["setup"] for r in runs if r["workload"] == workload):
            print(
                f"| {workload} | {setup} | {span(values(workload, setup, 'hit_rate'), 100, 1)} "
                f"| {span(values(workload, setup, 'ttft_p50_ms'))} | {span(values(workload, setup, 'ttft_p99_ms'))} "
                f"| {span(values(workload, setup, 'output_tok_s'), digits=1)} |"
            )
        by_round = {}
        for r in runs:
            if r["workload"] == workload:
                by_round.setdefault(r["round"], {})[r["setup"]] = r
        hits = [b["prefix"]["hit_rate"] / b["one_replica"]["hit_rate"] for b in by_round.values()
                if b.get("prefix", {}).get("hit_rate") and b.get("one_replica", {}).get("hit_rate")]  # fmt: skip
        ttft = [b["power_of_two"]["ttft_p99_ms"] / b["prefix"]["ttft_p99_ms"] for b in by_round.values()
                if b.get("prefix", {}).get("ttft_p99_ms") and b.get("power_of_two", {}).get("ttft_p99_ms")]  # fmt: skip
        pooled = {
            setup: float(np.percentile(ttfts, 99) * 1000)
            for setup in SETUPS
            if (ttfts := [t for r in runs if r["workload"] == workload and r["setup"] == setup for t in r["ttfts_s"]])
        }
        print(
            f"\n{workload}: prefix router's hit rate / one replica's: {span(hits, digits=2)}; "
            f"TTFT p99 default router / prefix router: {span(ttft, digits=2)}x by round"
        )
        print(
            "TTFT p99 over every round's requests pooled (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in pooled.items())
        )
        if "prefix" in pooled and "power_of_two" in pooled:
            print(f"pooled TTFT p99 default router / prefix router: {pooled['power_of_two'] / pooled['prefix']:.2f}x\n")


if __name__ == "__main__":
    sys.exit(main())
