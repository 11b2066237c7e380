"""A `--quantization gguf` start in two checkouts of tachyllm, alternating (A B A B ...), each in a fresh
process: load time, peak and settled RSS, single-stream decode speed, and whether both give the same
greedy tokens and log-probs. For changes to what a packed GGUF model holds in memory (session 23: the
token embedding looked up on the file's blocks instead of a dequantized table). With --draft, the
model runs with that draft model file (speculative decoding, 4 tokens a step).

    .venv/bin/python benchmarks/gguf_start_ab.py --a /work/base --b . --rounds 2 \\
        --model /work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

No checkpoint-cache entry is read or written (TACHY_CACHE_DIR=off): a packed start writes none anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPTS = ["def fib(n):", "The capital of France is", "Write a haiku about the sea.", "import numpy as np\n"]

WORKER = r"""
import json, sys, time
t = time.perf_counter()
from tachyllm import LLM, SamplingParams
model, threads, tokens, draft = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4} if draft else None
llm = LLM(model=model, quantization="gguf", max_model_len=512, threads=threads, kv_cache_memory=1 << 28,
          speculative_config=spec)
load = time.perf_counter() - t

def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) / 2**20  # GiB

settled = status("VmRSS:")
greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
outs = llm.generate(json.loads(sys.argv[4]), greedy, use_tqdm=False)
text = [[(t, round(d[t].logprob, 4)) for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
timed = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
rates = []
for _ in range(3):
    t = time.perf_counter()
    llm.generate([[100, 200, 300, 400]], timed, use_tqdm=False)
    rates.append(tokens / (time.perf_counter() - t))
print(json.dumps({"load_s": load, "peak_gib": status("VmHWM:"), "settled_gib": settled,
                  "decode_tok_s": sorted(rates)[1], "text": text}))
"""


def run(tree: Path, model: str, threads: int, tokens: int, draft: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()), TACHY_CACHE_DIR="off")
    args = [sys.executable, "-c", WORKER, model, str(threads), str(tokens), json.dumps(PROMPTS), draft]
    # In the tree's directory: `python -c` puts the working directory ahead of PYTHONPATH.
    out = subprocess.run(args, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B (the change)")
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per timed generation")
    parser.add_argument("--draft", default="", help="a GGUF draft model file (speculative decoding, k = 4)")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name, tree in (("A", args.a), ("B", args.b)) if r % 2 == 0 else (("B", args.b), ("A", args.a)):
            res = run(tree, args.model, args.threads, args.tokens, args.draft)
            results[name].append(res)
            print(
                f"round {r + 1} {name}: load {res['load_s']:.1f} s, peak RSS {res['peak_gib']:.2f} GiB, "
                f"settled RSS {res['settled_gib']:.2f} GiB, decode {res['decode_tok_s']:.1f} tok/s",
                flush=True,
            )
    for key, unit in (("load_s", "s"), ("peak_gib", "GiB"), ("settled_gib", "GiB"), ("decode_tok_s", "tok/s")):
        a, b = ([res[key] for res in results[n]] for n in ("A", "B"))
        print(f"{key}: A {', '.join(f'{v:.2f}' for v in a)} {unit}; B {', '.join(f'{v:.2f}' for v in b)} {unit}; "
              f"B/A of the medians {statistics.median(b) / statistics.median(a):.3f}")  # fmt: skip
    texts = {json.dumps(res["text"]) for n in ("A", "B") for res in results[n]}
    print("same greedy tokens and log-probs in every run:", len(texts) == 1)


if __name__ == "__main__":
    main()
