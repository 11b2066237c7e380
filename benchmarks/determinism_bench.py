"""What the batch-invariant mode (`--deterministic`, the default; docs/determinism.md) costs against
`--no-deterministic`, side by side in one process on the default model, runs alternating (A B A B ...):

1. single stream: one 128-token prompt, 128 greedy output tokens: time to first token and decode tok/s;
2. a long prompt: time to first token of one 2,000-token prompt (prefill chunks of 2,048 rows);
3. offline batch: 64 prompts of 128 tokens, 128 output tokens each, all at once: output tok/s;
4. with --served: `tachy serve` in each mode (in turn, alternating) measured by `tachy bench serve`
   with the same 64 x 128/128 all at once: output tok/s, TTFT p50 / p99, TPOT p50.

    .venv/bin/python benchmarks/determinism_bench.py [--rounds 2] [--threads 2] [--dtype bfloat16] [--served]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tachyllm import LLM, SamplingParams

TEXT = (
    "The river ran past the old mill, where the miller's children counted boats and argued about the "
    "weather, the price of flour, and whether the bridge would hold another winter of floods. "
)


def make_prompts(llm: LLM, first: int, count: int, length: int) -> list[list[int]]:
    """Prompts numbered first .. first + count - 1: each starts with its own number, so that no two
    share a cached block (every run computes its whole prefill, as fresh requests do)."""
    tokenizer = llm.get_tokenizer()
    body = tokenizer.encode(TEXT * (length // 20 + 1), add_special_tokens=False)
    return [
        (tokenizer.encode(f"Story {n}: ", add_special_tokens=False) + body)[:length]
        for n in range(first, first + count)
    ]


def single_stream(llm: LLM, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(TTFT seconds, decode tok/s after the first token)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ttft = out.metrics.ttft
    decode_seconds = out.metrics.mean_tpot * (output_len - 1)
    return ttft, (output_len - 1) / decode_seconds


def batch(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of the whole batch, from adding the requests to the last token."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def served(mode: str, args: argparse.Namespace, seed: int) -> dict:
    """`tachy bench serve` metrics of 64 x 128/128 all at once against `tachy serve` in this mode."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tachy = [sys.executable, "-m", "tachyllm.entrypoints.cli"]
    flag = "--deterministic" if mode == "deterministic" else "--no-deterministic"
    server = subprocess.Popen(
        [*tachy, "serve", "--port", str(port), "--threads", str(args.threads), "--dtype", args.dtype, flag],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"tachy serve {flag} did not come up")
            time.sleep(0.3)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            subprocess.run(
                [*tachy, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "64",
                 "--input-len", "128", "--output-len", "128", "--ignore-eos", "--seed", str(seed), "--no-progress",
                 "--result-json", str(out)],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            return json.loads(out.read_text())["runs"][0]["metrics"]
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--served", action="store_true", help="also measure the served 64 x 128/128 burst")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engines = {
        mode: LLM(dtype=args.dtype, threads=args.threads, deterministic=mode == "deterministic")
        for mode in ("off", "deterministic")
    }
    results = {mode: {"ttft_s": [], "decode_tok_s": [], "long_ttft_s": [], "batch_tok_s": []} for mode in engines}
    for mode, llm in engines.items():  # warm-up: first-call allocations, thread pools
        batch(llm, make_prompts(llm, 10_000, 4, 128), 8)
    run = 0
    for round_ in range(args.rounds):
        for mode, llm in engines.items():
            run += 1
            prompts = make_prompts(llm, run * 100, 65, 128)
            ttft, decode = single_stream(llm, prompts[64], 128)
            long_ttft, _ = single_stream(llm, make_prompts(llm, run * 100 + 99, 1, 2000)[0], 2)
            tok_s = batch(llm, prompts[:64], 128)
            results[mode]["ttft_s"].append(ttft)
            results[mode]["decode_tok_s"].append(decode)
            results[mode]["long_ttft_s"].append(long_ttft)
            results[mode]["batch_tok_s"].append(tok_s)
            print(
                f"round {round_ + 1} {mode:>13}: TTFT {ttft * 1e3:6.1f} ms, decode {decode:6.1f} tok/s, "
                f"2,000-token TTFT {long_ttft * 1e3:6.1f} ms, 64 x 128/128 {tok_s:6.1f} out tok/s",
                flush=True,
            )
    print("\nratio deterministic / off (per round):")
    for key in ("ttft_s", "decode_tok_s", "long_ttft_s", "batch_tok_s"):
        ratios = [d / a for d, a in zip(results["deterministic"][key], results["off"][key])]
        print(f"  {key:>13}: " + ", ".join(f"{r:.3f}" for r in ratios) + f"  (median {statistics.median(ratios):.3f})")
    served_results: dict[str, list[dict]] = {mode: [] for mode in engines}
    if args.served:
        del engines  # the servers get the memory and the cores
        print("\nserved, 64 x 128/128 all at once:")
        for round_ in range(args.rounds):
            for mode in served_results:
                m = served(mode, args, round_)
                served_results[mode].append(m)
                print(
                    f"round {round_ + 1} {mode:>13}: {m['output_throughput']:6.1f} out tok/s, "
                    f"TTFT p50 {m['ttft_ms']['median']:.0f} p99 {m['ttft_ms']['p99']:.0f} ms, "
                    f"TPOT p50 {m['tpot_ms']['median']:.1f} ms, failed {m['failed']}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": results, "served": served_results}, f, indent=2)


if __name__ == "__main__":
    main()
