"""tachyllm vs llama.cpp on the same GGUF file, side by side in one run.

For one model file, every round runs each configuration once, in turn, so that the machine's load
drifts across all of them alike:

- single stream: decode tok/s (`tachy bench latency --batch-size 1`, the median decode step; llama.cpp's
  `llama-bench -p 0 -n N`, its generation rate);
- batch: `--num-prompts` requests of `--input-len` in / `--output-len` out, all at once; output tokens
  over the wall time, prefill included (`tachy bench throughput`; llama.cpp's `llama-batched-bench`
  with that many parallel sequences: pl x tg / t).

tachyllm configurations: `gguf` (the file's blocks packed, activations rounded as the load-time check
decides: 8 bits where they keep the model within its KL bound, else 16; the default), `gguf-a16` and
`gguf-a8` (`--quant-activation-bits 16` / `8`; 8 is llama.cpp's own rounding of activations) and `bf16`
(the file dequantized). llama.cpp is not a dependency: build `llama-bench` and `llama-batched-bench` from the
llama.cpp sources vendored in llama-cpp-python's sdist (docs/benchmarks.md says how) and pass their
folder with `--llama-bin`.

    python benchmarks/gguf_vs_llamacpp.py --model MODEL.gguf --llama-bin DIR [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TACHY_CONFIGS = {
    "gguf": ["--quantization", "gguf"],
    "gguf-a16": ["--quantization", "gguf", "--quant-activation-bits", "16"],
    "gguf-a8": ["--quantization", "gguf", "--quant-activation-bits", "8"],
    "bf16": ["--dtype", "bfloat16"],
}


ROUNDING = re.compile(r"activations rounded to \d+ bits[^\n]*|quant_activation_bits \d+: [^\n]*")


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done


def tachy(args: argparse.Namespace, sub: str, flags: list[str], extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "tachyllm.entrypoints.cli", "bench", sub, "--model", args.model]
        cmd += ["--threads", str(args.threads), "--max-model-len", str(args.max_model_len)]
        done = run(cmd + flags + extra + ["--result-json", str(result)])
        # Which rounding the engine ran (gguf unset: its load-time check's choice), from its log.
        rounding = ROUNDING.search(done.stdout + done.stderr)
        if rounding:
            print(f"  tachyllm {' '.join(flags)}: {rounding.group(0)}", flush=True)
        return json.loads(result.read_text())["result"]


def tachy_single(args: argparse.Namespace, flags: list[str]) -> float:
    extra = ["--batch-size", "1", "--input-len", "32", "--output-len", str(args.single_tokens)]
    extra += ["--num-iters", "3", "--num-iters-warmup", "1"]
    return tachy(args, "latency", flags, extra)["decode_steps_per_s"]


def tachy_batch(args: argparse.Namespace, flags: list[str]) -> float:
    extra = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len)]
    extra += ["--output-len", str(args.output_len), "--no-progress"]
    return tachy(args, "throughput", flags, extra)["output_throughput"]


def llama_single(args: argparse.Namespace) -> float:
    cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", args.model, "-t", str(args.threads), "-p", "0"]
    cmd += ["-n", str(args.single_tokens), "-r", "3", "-o", "json"]
    rows = json.loads(run(cmd).stdout)
    return next(r["avg_ts"] for r in rows if r["n_gen"] > 0)


def llama_batch(args: argparse.Namespace) -> float:
    ctx = args.num_prompts * (args.input_len + args.output_len)
    cmd = [str(Path(args.llama_bin) / "llama-batched-bench"), "-m", args.model, "-t", str(args.threads)]
    cmd += ["-c", str(ctx), "-npp", str(args.input_len), "-ntg", str(args.output_len), "-npl", str(args.num_prompts)]
    cmd += ["--output-format", "jsonl"]
    line = next(ln for ln in run(cmd).stdout.splitlines() if ln.startswith("{"))
    row = json.loads(line)
    return row["pl"] * row["tg"] / row["t"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-bin", required=True, help="folder holding llama-bench and llama-batched-bench")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--single-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--configs", default="gguf,gguf-a16,bf16", help="tachyllm configurations, in run order")
    parser.add_argument("--skip", default="", help="comma list among single,batch")
    args = parser.parse_args()
    configs = args.configs.split(",")
    modes = [m for m in ("single", "batch") if m not in args.skip.split(",")]
    results: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for mode in modes:
            for name in ["llama.cpp", *configs]:
                if name == "llama.cpp":
                    value = llama_single(args) if mode == "single" else llama_batch(args)
                else:
                    flags = TACHY_CONFIGS[name]
                    value = tachy_single(args, flags) if mode == "single" else tachy_batch(args, flags)
                results.setdefault((mode, name), []).append(value)
                print(f"round {round_ + 1} {mode:6s} {name:10s} {value:8.1f} tok/s", flush=True)
    print("\n| mode | engine | tok/s per round | vs llama.cpp per round (median) |\n|---|---|---|---|")
    for mode in modes:
        base = results[(mode, "llama.cpp")]
        for name in ["llama.cpp", *configs]:
            values = results[(mode, name)]
            ratios = [v / b for v, b in zip(values, base)]
            shown = ", ".join(f"{v:.1f}" for v in values)
            rel = ", ".join(f"{r:.2f}" for r in ratios) + f" ({statistics.median(ratios):.2f}x)"
            print(f"| {mode} | {name} | {shown} | {rel} |")


if __name__ == "__main__":
    main()
