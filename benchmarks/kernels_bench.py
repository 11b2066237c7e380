"""Kernel micro-benchmarks behind two design choices, each pair measured side by side in one run:

linear:    oneDNN-prepacked bf16 linear (tachyllm/kernels/linear.py) vs plain F.linear, at the
           default model's shapes and 1 / 64 / 512 tokens.
attention: tachyllm's tiled causal grouped-matmul prefill attention vs F.scaled_dot_product_attention
           (bf16, 9 query heads, 3 KV heads, head_dim 64).

    .venv/bin/python benchmarks/kernels_bench.py --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tachyllm.kernels.linear import PackedLinear
from tachyllm.kernels.paged_attention import causal_attention


def per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def bench_linear() -> None:
    print("| weight (out x in) | tokens | F.linear µs | packed µs | ratio |\n|---|---|---|---|---|")
    for out_f, in_f in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:
        linear = torch.nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
        packed = PackedLinear(linear)
        for tokens in (1, 64, 512):
            x = torch.randn(tokens, in_f, dtype=torch.bfloat16)
            calls = 10 if out_f * tokens > 10**6 else 100
            plain = per_call_us(lambda: F.linear(x, linear.weight), calls)
            fast = per_call_us(lambda: packed(x), calls)
            print(f"| {out_f}x{in_f} | {tokens} | {plain:.0f} | {fast:.0f} | {plain / fast:.2f}x |")


def bench_attention() -> None:
    print("\n| chunk | cached tokens | SDPA ms | tachyllm ms | ratio |\n|---|---|---|---|---|")
    for length, cached in [(16, 4080), (512, 0), (2048, 0)]:
        q = torch.randn(length, 9, 64, dtype=torch.bfloat16)
        k = torch.randn(cached + length, 3, 64, dtype=torch.bfloat16)
        v = torch.randn(cached + length, 3, 64, dtype=torch.bfloat16)
        mask = torch.arange(cached + length)[None] <= torch.arange(cached, cached + length)[:, None]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

        def sdpa():
            if cached:
                return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=0.125)
            return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True, scale=0.125)

        ref = per_call_us(sdpa, 3) / 1e3
        ours = per_call_us(lambda: causal_attention(q, k, v, cached, 0.125), 3) / 1e3
        print(f"| {length} | {cached} | {ref:.1f} | {ours:.1f} | {ref / ours:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("sections", nargs="*", help="linear and/or attention (default: both)")
    args = ap.parse_args()
    args.sections = args.sections or ["linear", "attention"]
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    with torch.inference_mode():
        if "linear" in args.sections:
            bench_linear()
        if "attention" in args.sections:
            bench_attention()


if __name__ == "__main__":
    main()
