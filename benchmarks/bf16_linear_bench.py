"""The C++ bf16 linear kernel (kernels/csrc/bf16_gemv.cpp) against PyTorch's linears, in GMAC/s
(rows x out x in multiply-adds per second), at the default model's shapes (SmolLM2-135M: hidden 576,
intermediate 1536, 9 heads x 64, 3 KV heads, vocabulary 49,152), 1 / 128 / 512 token rows (the LM
head at 1 and 128: a step computes logits only for the rows it samples) and 1 / 2 threads:

kernel:         ops.bf16_linear on the plain bf16 weight (what PackedLinear runs);
F.linear bf16:  PyTorch on the same weight (oneDNN, where it has bf16 kernels: AVX-512);
F.linear fp32:  PyTorch on an fp32 copy of the weight, fp32 inputs (MKL / oneDNN).

Each measurement cycles over copies of the weight (>= 64 MB in all, so that one-row products read
them from DRAM, as a decode step does) and keeps the best of 3 runs of ~50 ms. The implementations
alternate (A B C, then C B A, ...) for --rounds rounds; each cell is the range over the rounds.

The kernel's instruction set is the build's (printed first); on an AVX-512 machine the AVX2 path is
built with TACHY_NATIVE_MARCH=haswell (PyTorch's linears keep the machine's instructions):

    TACHY_NATIVE_MARCH=haswell .venv/bin/python benchmarks/bf16_linear_bench.py [--rounds 2] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tachyllm.kernels.native import native_ops

# (name, out, in) of the default model's matrices: fused qkv (9 + 2 * 3 heads of 64), o, fused gate_up, down, head.
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]
HEAD_MAX_ROWS = 128
COPY_BYTES = 64e6


@dataclass
class Impl:
    name: str
    calls: Callable[[torch.Tensor, list[torch.Tensor]], list[Callable[[], torch.Tensor]]]
    fp32: bool = False  # runs on fp32 weights and inputs


def _impls(ops) -> list[Impl]:
    return [
        Impl("kernel", lambda x, ws: [lambda w=w: ops.bf16_linear(x, w) for w in ws]),
        Impl("F.linear bf16", lambda x, ws: [lambda w=w: F.linear(x, w) for w in ws]),
        Impl("F.linear fp32", lambda x, ws: [lambda w=w: F.linear(x, w) for w in ws], fp32=True),
    ]


def best_seconds(fns: list[Callable[[], torch.Tensor]], target: float = 0.05) -> float:
    fns[0]()
    start = time.perf_counter()
    fns[1 % len(fns)]()
    calls = max(1, int(target / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 128, 512])
    args = ap.parse_args()
    ops = native_ops()
    if ops is None:
        raise SystemExit("the C++ kernels could not be built")
    march = os.environ.get("TACHY_NATIVE_MARCH", "native")
    print(f"kernel: {ops.bf16_linear_isa} (-march={march}); torch {torch.__version__}")
    impls = _impls(ops)
    print("| weight (out x in) | rows | threads | " + " | ".join(f"{i.name} GMAC/s" for i in impls) + " |")
    print("|---|---|---|" + "---|" * len(impls))
    torch.manual_seed(0)
    for name, out_f, in_f in SHAPES:
        weight = torch.randn(out_f, in_f, dtype=torch.bfloat16)
        copies = [weight.clone() for _ in range(max(2, int(COPY_BYTES // (out_f * in_f * 2))))]
        fp32_copies = [w.float() for w in copies]
        for rows in args.rows:
            if name == "lm_head" and rows > HEAD_MAX_ROWS:
                continue
            x = torch.randn(rows, in_f, dtype=torch.bfloat16)
            for threads in args.threads:
                torch.set_num_threads(threads)
                results: dict[str, list[float]] = {i.name: [] for i in impls}
                for r in range(args.rounds):
                    for impl in impls if r % 2 == 0 else impls[::-1]:
                        fns = impl.calls(x.float(), fp32_copies) if impl.fp32 else impl.calls(x, copies)
                        results[impl.name].append(rows * out_f * in_f / best_seconds(fns) / 1e9)
                cells = " | ".join(f"{min(v):.1f}-{max(v):.1f}" for v in results.values())
                print(f"| {name} {out_f}x{in_f} | {rows} | {threads} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
