"""The cuda backend's Triton kernels against their PyTorch alternatives, on a GPU:

- quantized GEMMs (kernels/triton/quant_matmul.py) at Llama-3-8B's linear shapes, for 1 / 16 / 256
  rows: int4 (group 128) and int8 in the Triton kernels, against the bf16 matmul of the same shape
  and the dequantize-then-matmul path they replace; fp8 (torch._scaled_mm with per-token scales);
  reported as microseconds and as the weight-streaming bandwidth they reach;
- the elementwise ops (kernels/triton/fused_ops.py) against the portable PyTorch ops, eager and under
  torch.compile (one compile per shape: `dynamic=False`), for 1 / 256 tokens: the measurement that
  decides Triton or torch.compile for them.

    python benchmarks/triton_kernels_bench.py            # ~1 min on an H200 (compiles included)
    python benchmarks/triton_kernels_bench.py --json

Timings: CUDA events around 50 calls after 5 warm-up calls; median of 5 such runs.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from tachyllm.backends.base import PORTABLE_OPS
from tachyllm.backends.triton_ops import TritonOps
from tachyllm.kernels.triton import quant_matmul as qm
from tachyllm.quantization.fp8 import Fp8Linear
from tachyllm.quantization.int4 import quantize_int4
from tachyllm.quantization.int8 import quantize_int8

# Llama-3-8B: (name, N, K) of its linears (fused qkv and gate_up as tachyllm runs them).
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = (1, 16, 256)


def timed(fn, calls: int = 50) -> float:
    """Median microseconds per call."""
    for _ in range(5):
        fn()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(runs)


def gemms() -> list[dict]:
    out = []
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        q4 = quantize_int4(w, 128)
        packed4 = qm.pack_int4(q4.codes, q4.scales, q4.mins, 128)
        codes8, scales8 = quantize_int8(w)
        packed8 = qm.pack_int8(codes8)
        w_bf16 = w.bfloat16()
        fp8 = Fp8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device="cuda"))
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cases = {
                "bf16 matmul": (lambda: x @ w_bf16.t(), n * k * 2),
                "int4 triton": (lambda: qm.int4_matmul(x, *packed4, 128), n * k // 2),
                "int4 dequantize+matmul": (lambda: x @ q4.dequantize().bfloat16().t(), n * k // 2),
                "int8 triton": (lambda: qm.int8_matmul(x, packed8, scales8), n * k),
                "fp8 _scaled_mm": (lambda: fp8(x), n * k),
            }
            for case, (fn, weight_bytes) in cases.items():
                us = timed(fn)
                out.append({"shape": name, "rows": m, "case": case, "us": round(us, 1),
                            "weight_GBps": round(weight_bytes / us / 1e3, 1)})  # fmt: skip
    return out


def elementwise() -> list[dict]:
    out = []
    triton_ops = TritonOps()
    hidden, heads, kv_heads, head_dim, inter = 4096, 32, 8, 128, 14336
    cos = torch.randn(8192, head_dim // 2, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    for tokens in (1, 256):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        pos = torch.arange(tokens, device="cuda")
        gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
        calls = {
            "add_rms_norm": lambda ops: ops.add_rms_norm(x, x, weight, 1e-5),
            "rotary": lambda ops: ops.rotary(pos, q, k, cos, cos),
            "silu_mul": lambda ops: ops.silu_mul(gate_up),
        }
        for op, call in calls.items():
            compiled = torch.compile(lambda call=call: call(PORTABLE_OPS), dynamic=False)
            for impl, fn in (("torch eager", lambda: call(PORTABLE_OPS)), ("torch.compile", compiled),
                             ("triton", lambda: call(triton_ops))):  # fmt: skip
                out.append({"op": op, "tokens": tokens, "impl": impl, "us": round(timed(fn), 1)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    results = {"device": torch.cuda.get_device_name(), "gemms": gemms(), "elementwise": elementwise()}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(results["device"])
    for r in results["gemms"]:
        print(f"{r['shape']:>8} M={r['rows']:<4} {r['case']:<24} {r['us']:>9.1f} us {r['weight_GBps']:>8.1f} GB/s")
    for r in results["elementwise"]:
        print(f"{r['op']:>13} T={r['tokens']:<4} {r['impl']:<14} {r['us']:>8.1f} us")


if __name__ == "__main__":
    main()
