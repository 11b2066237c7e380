"""The CPU fast path: the engine with and without its C++ kernels, side by side in one run.

For each of bf16 weights and the GGUF's own Q4_1 weights (`--quantization gguf`), with the C++
kernels (tachyllm/kernels/csrc) and with the pure-PyTorch path (what TACHY_NATIVE=0 gives), and
for the Q4_1 weights with the kernels' 8-bit activations (`--quant-activation-bits 8`; gguf's
load-time check picks 8 for this model, so the 16-bit rows are `--quant-activation-bits 16`):
  - single stream: 32-token prompt, 128 new tokens, decode tokens/s (median of --repeats) and the
    achieved weight bandwidth (weight bytes read per step x steps/s) against a measured copy;
  - offline batch: 64 prompts x 128 tokens, 128 new tokens each, output tokens/s (prefill included).
Greedy, EOS ignored. The competitors are measured by benchmarks/competitors/run_all.sh.

    .venv/bin/python benchmarks/cpu_fast_path_bench.py --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import statistics
import time

import torch

from tachyllm import LLM, SamplingParams
from tachyllm.bench.offline import measure_bandwidth_gbs
from tachyllm.kernels import native

VLLM_OFFLINE_TOK_S, VLLM_SINGLE_TOK_S = 458, 41


@contextlib.contextmanager
def kernels(enabled: bool):
    """Without: every caller sees no C++ kernels, as with TACHY_NATIVE=0 (decided at model build and per call)."""
    saved = native.native_ops
    if not enabled:
        native.native_ops = lambda: None
    try:
        yield
    finally:
        native.native_ops = saved


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def single_stream(llm: LLM, prompt: list[int], new: int, repeats: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate([prompt[:8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return statistics.median(
        1.0 / llm.generate([prompt], params, use_tqdm=False)[0].metrics.mean_tpot for _ in range(repeats)
    )


def batch(llm: LLM, batch_prompts: list[list[int]], new: int) -> float:
    start = time.perf_counter()
    outs = llm.generate(batch_prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--skip-eager-batch", action="store_true", help="the PyTorch-path batch runs are the slowest part")
    args = ap.parse_args()
    if native.native_ops() is None:
        raise SystemExit("the C++ kernels are not available here: nothing to compare")

    rows = []
    # (label, quantization, activation bits, kernels on); 8-bit activations exist only in the kernels.
    configs = [("bf16", None, 16, True), ("bf16", None, 16, False), ("gguf", "gguf", 16, True),
               ("gguf", "gguf", 16, False), ("gguf, 8-bit activations", "gguf", 8, True)]  # fmt: skip
    for name, quantization, bits, enabled in configs:
        with kernels(enabled):
            llm = LLM(dtype="bfloat16", quantization=quantization, quant_activation_bits=bits, threads=args.threads,
                      max_num_seqs=args.batch, max_num_batched_tokens=4096)  # fmt: skip
            vocab = llm.engine.model_config.vocab_size
            one = single_stream(llm, prompts(1, 32, vocab, 0)[0], 128, args.repeats)
            many = None
            if enabled or not args.skip_eager_batch:
                many = batch(llm, prompts(args.batch, 128, vocab, 1), 128)
            rows.append((name, enabled, one, many, llm.engine.weight_bytes))
        del llm
        gc.collect()
    gbs = measure_bandwidth_gbs(torch.device("cpu"))

    print(
        f"default model, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"measured copy bandwidth {gbs:.1f} GB/s"
    )
    print(
        "| weights | kernels | single-stream decode tok/s | weight bandwidth | "
        "offline 64 x (128 in / 128 out) output tok/s |"
    )
    print("|---|---|---|---|---|")
    for name, enabled, one, many, weight_bytes in rows:
        bw = weight_bytes * one / 1e9
        many_text = f"{many:.1f}" if many is not None else "skipped"
        print(
            f"| {name} | {'C++' if enabled else 'PyTorch'} | {one:.1f} | "
            f"{bw:.1f} GB/s ({100 * bw / gbs:.0f}%) | {many_text} |"
        )
    for name in ("bf16", "gguf"):
        fast, slow = (r for r in rows if r[0] == name)
        ratio_b = f", batch {fast[3] / slow[3]:.2f}x" if slow[3] else ""
        print(f"{name}: C++ kernels / PyTorch path: single stream {fast[2] / slow[2]:.2f}x{ratio_b}")
    # vLLM runs in an environment of its own (benchmarks/competitors); the figure is its offline run on the
    # reference machine.
    for name, enabled, one, many, _ in rows:
        if enabled and many is not None:
            print(f"{name}: offline {many / VLLM_OFFLINE_TOK_S:.2f}x vLLM CPU bf16's {VLLM_OFFLINE_TOK_S} tok/s, "
                  f"single stream {one / VLLM_SINGLE_TOK_S:.2f}x its {VLLM_SINGLE_TOK_S} tok/s")  # fmt: skip


if __name__ == "__main__":
    main()
