"""A lone embedding step after the engine sat idle, compute workers pinned (`--omp-threads-bind auto`,
the default) against `nobind`, each in a process of its own (a pinned OpenMP worker stays pinned),
the two taking turns.

    .venv/bin/python benchmarks/idle_step_bench.py [--threads 2] [--rounds 2] [--repeats 60]

all-MiniLM-L6-v2 (benchmarks/minilm_model.py), bf16; inputs of 10, 32 and 79 tokens (79: the corpus
p99 of benchmarks/sentence_corpus.py); `LLM.embed` of one input --repeats times back to back, then
--repeats times each after --idle-ms of sleep: p50 / p90 ms per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from minilm_model import minilm_folder  # noqa: E402

LENGTHS = (10, 32, 79)
MODES = ("auto", "nobind")


def quantiles(ms: list[float]) -> tuple[float, float]:
    ordered = sorted(ms)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]


def worker(mode: str, threads: int, repeats: int, idle_s: float) -> None:
    from tachyllm import LLM

    llm = LLM(str(minilm_folder()), threads=threads, omp_threads_bind=mode)
    result = {}
    for length in LENGTHS:
        prompt = [{"prompt_token_ids": [101] + [2000 + i for i in range(length - 2)] + [102]}]
        for _ in range(3):
            llm.embed(prompt)
        for idle in (0.0, idle_s):
            ms = []
            for _ in range(repeats):
                time.sleep(idle)
                start = time.perf_counter()
                llm.embed(prompt)
                ms.append((time.perf_counter() - start) * 1000)
            result[f"{length} {idle}"] = quantiles(ms)
    print("RESULT " + json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--idle-ms", type=float, default=30.0)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.threads, args.repeats, args.idle_ms / 1000)
        return
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            flags = ["--worker", mode, "--threads", str(args.threads), "--repeats", str(args.repeats),
                     "--idle-ms", str(args.idle_ms)]  # fmt: skip
            done = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True, check=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            runs[mode].append(json.loads(line.removeprefix("RESULT ")))
            print(f"round {round_index + 1}, {mode} done", flush=True)
    print(f"\nLLM.embed of one input, {args.threads} threads, {args.rounds} rounds, p50 / p90 ms (ranges over rounds)")
    print("| tokens | idle before | " + " | ".join(f"`{m}`" for m in MODES) + " |")
    print("|---|---|" + "---|" * len(MODES))
    for length in LENGTHS:
        for idle in (0.0, args.idle_ms / 1000):
            cells = []
            for mode in MODES:
                p50s, p90s = zip(*(run[f"{length} {idle}"] for run in runs[mode]))
                cells.append(f"{min(p50s):.1f}–{max(p50s):.1f} / {min(p90s):.1f}–{max(p90s):.1f}")
            print(f"| {length} | {idle * 1000:.0f} ms | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
