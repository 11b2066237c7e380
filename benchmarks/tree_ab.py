"""Two checkouts of tachyllm side by side, for a change that must not slow anything down (a
refactoring, a new code path beside the old): the same measurements, each in a fresh process importing
one tree or the other, in alternating rounds (A B A B ...), so that drift of a shared machine hits both alike.

    .venv/bin/python benchmarks/tree_ab.py --a ../baseline --b . --rounds 2

Measurements (default model, greedy, EOS ignored, --threads threads):
  single   single-stream decode tok/s: 32-token prompt, 128 new tokens, median of 3 (as cpu_fast_path_bench.py)
  offline  64 prompts x 128 tokens, 128 new each, output tok/s, prefill included (as cpu_fast_path_bench.py)
  served   `tachy serve` in the tree under test, `tachy bench serve` (this tree's client, for both) with
           64 x 128/128 requests at once: output tok/s
  attention the C++ paged attention kernel alone, one layer's call for a 64-sequence decode step after
           200 cached positions (9 query heads, 3 KV heads, head_dim 64, bf16 cache): query tokens per
           second, best of 5 repeats of 30 calls (weights do not apply)
  attention_prefill  the same kernel for a prefill step of 32 sequences x 128 new tokens, no cache
for bf16 weights and the GGUF's own Q4_1 weights (--quantization gguf). Prints every round and, per
measurement, B / A as the range over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

WEIGHTS = {"bf16": [], "gguf": ["--quantization", "gguf"]}


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def attention_worker(threads: int, seqs: int, queries: int, cached: int, calls: int) -> dict:
    """kernels.native's paged_attention, whose signature every tree since the C++ kernels has kept."""
    import torch

    from tachyllm.kernels.native import native_ops

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    block_size = 16
    width = -(-(cached + queries) // block_size)
    k_cache, v_cache = (torch.randn(seqs * width, block_size, 3, 64, dtype=torch.bfloat16) for _ in range(2))
    tables = torch.randperm(seqs * width).to(torch.int32).reshape(seqs, width)
    info = torch.tensor([[i * queries, queries, cached] for i in range(seqs)], dtype=torch.int32)
    q = torch.randn(seqs * queries, 9, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ops = native_ops()
    ops.paged_attention(out, q, k_cache, v_cache, tables, info, 0.125)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            ops.paged_attention(out, q, k_cache, v_cache, tables, info, 0.125)
        best = min(best, (time.perf_counter() - start) / calls)
    return {"tok_s": seqs * queries / best}


def worker(kind: str, weights: str, threads: int) -> dict:
    """Runs in the tree under test (PYTHONPATH): only LLM and SamplingParams, which every tree has."""
    if kind == "attention":
        return attention_worker(threads, seqs=64, queries=1, cached=200, calls=30)
    if kind == "attention_prefill":
        return attention_worker(threads, seqs=32, queries=128, cached=0, calls=3)
    from tachyllm import LLM, SamplingParams

    quantization = "gguf" if weights == "gguf" else None
    llm = LLM(
        dtype="bfloat16", quantization=quantization, threads=threads, max_num_seqs=64, max_num_batched_tokens=4096
    )
    vocab = llm.engine.model_config.vocab_size
    greedy = {"temperature": 0, "ignore_eos": True}
    if kind == "single":
        prompt = _prompts(1, 32, vocab, 0)[0]
        llm.generate([prompt[:8]], SamplingParams(max_tokens=8, **greedy), use_tqdm=False)
        params = SamplingParams(max_tokens=128, **greedy)
        rates = [1.0 / llm.generate([prompt], params, use_tqdm=False)[0].metrics.mean_tpot for _ in range(3)]
        return {"tok_s": statistics.median(rates)}
    batch = _prompts(64, 128, vocab, 1)
    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(max_tokens=128, **greedy), use_tqdm=False)
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(tree: Path, weights: str, threads: int) -> dict:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    serve = "import sys; from tachyllm.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", serve, "serve", "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
           "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", *WEIGHTS[weights]]  # fmt: skip
    server = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            client = [sys.executable, "-c", serve, "bench", "serve", "--base-url", base, "--num-prompts", "64",
                      "--input-len", "128", "--output-len", "128", "--ignore-eos", "--request-rate", "inf",
                      "--no-progress", "--result-json", str(result)]  # fmt: skip
            subprocess.run(
                client, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(Path.cwd())}
            )
            return {"tok_s": json.loads(result.read_text())["runs"][0]["metrics"]["output_throughput"]}
    finally:
        server.terminate()
        server.wait(timeout=60)


def measure(tree: Path, kind: str, weights: str, threads: int) -> float:
    if kind == "served":
        return served(tree, weights, threads)["tok_s"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, weights, "--threads", str(threads)]
    out = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, help="the reference checkout")
    ap.add_argument("--b", type=Path, default=Path("."), help="the checkout under test")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="single,offline,served", help="comma list of measurements")
    ap.add_argument("--weights", default="bf16,gguf", help="comma list: bf16, gguf")
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "WEIGHTS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.threads)))
        return
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    weights = args.weights.split(",")
    cases = [(k, w) for k in args.only.split(",") for w in (["-"] if k.startswith("attention") else weights)]
    results: dict[tuple[str, str], dict[str, list[float]]] = {c: {"A": [], "B": []} for c in cases}
    for r in range(args.rounds):
        for kind, weights in cases:
            for label in ("A", "B") if r % 2 == 0 else ("B", "A"):
                value = measure(trees[label], kind, weights, args.threads)
                results[(kind, weights)][label].append(value)
                print(f"round {r + 1} {kind:8s} {weights:5s} {label}: {value:8.1f} tok/s", flush=True)
    print(f"\nA = {trees['A']}\nB = {trees['B']}\n{args.threads} threads, {args.rounds} rounds")
    print("| measurement | weights | A tok/s | B tok/s | B / A per round |")
    print("|---|---|---|---|---|")
    for (kind, weights), v in results.items():
        ratios = [b / a for a, b in zip(v["A"], v["B"])]
        a_text = ", ".join(f"{x:.1f}" for x in v["A"])
        b_text = ", ".join(f"{x:.1f}" for x in v["B"])
        print(f"| {kind} | {weights} | {a_text} | {b_text} | {min(ratios):.3f} - {max(ratios):.3f} |")


if __name__ == "__main__":
    main()
