"""Weight-only int8 / int4 linears on CPU: tachyllm's wrappers around PyTorch's packed ops
(Int8Linear -> aten._weight_int8pack_mm, Int4Linear -> aten._weight_int4pack_mm_for_cpu) against
torchao's weight-only configs, at the default model's (SmolLM2-135M) linear shapes, bf16 input.

torchao columns (skipped when torchao is not importable):
  int8: quantize_(linear, Int8WeightOnlyConfig())                        per-row int8, Int8Tensor
  int4: quantize_(linear, PrototypeInt4WeightOnlyConfig(group_size=64))  Int4OpaqueTensor, torchao's
        CPU int4 path (Int4WeightOnlyConfig's packing formats need mslk or CUDA)

Time per call in µs: every method of one (shape, tokens) cell is timed round-robin (`--rounds`
rounds, each a batch of calls sized to ~`--batch-ms`), and the median over rounds is reported, so a
shared machine's drift hits all columns alike. Error: max |y - ref| / max |ref| against the bf16
layer computed exactly (fp32 matmul of the same bf16 weight and input), 32 tokens.

    pip install --no-deps --target TORCHAO_DIR torchao==0.18.0   # outside .venv
    OMP_NUM_THREADS=1 PYTHONPATH=TORCHAO_DIR .venv/bin/python benchmarks/torchao_compare.py [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from tachyllm.quantization.int4 import Int4Linear
from tachyllm.quantization.int8 import Int8Linear

# (out, in): fused qkv, o_proj, fused gate_up, down, lm head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
TOKENS = (1, 32)
GROUP_SIZE = 64  # 576 is not a multiple of 128; tachyllm picks 64 for these layers too


def load_torchao():
    """(version, int8 config, int4 config) or (None, error, None) when torchao is unavailable."""
    try:
        import torchao
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import Int8WeightOnlyConfig
    except (ImportError, OSError, RuntimeError, AttributeError) as e:  # absent, or an ABI/API mismatch
        return None, f"{type(e).__name__}: {e}", None
    return (
        torchao.__version__,
        Int8WeightOnlyConfig(set_inductor_config=False),
        PrototypeInt4WeightOnlyConfig(group_size=GROUP_SIZE, set_inductor_config=False),
    )


def torchao_linear(linear: nn.Linear, config) -> nn.Module:
    from torchao.quantization import quantize_

    module = copy.deepcopy(linear)
    quantize_(module, config)
    return module


def time_methods(methods: dict, rounds: int, batch_ms: float) -> dict[str, float]:
    """Median per-call µs of each zero-argument callable, interleaved round-robin."""
    batch = {}
    for name, fn in methods.items():
        for _ in range(3):  # warm-up: first-call allocations, oneDNN primitive caches
            fn()
        start = time.perf_counter()
        fn()
        one = time.perf_counter() - start
        batch[name] = max(1, min(200, int(batch_ms / 1e3 / max(one, 1e-7))))
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            n = batch[name]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - start) / n * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def faster(a_name: str, a: float, b_name: str, b: float | None) -> str:
    if b is None:
        return "—"
    return f"{a_name} {b / a:.2f}x" if a <= b else f"{b_name} {a / b:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=25, help="timing rounds per cell (median over them)")
    ap.add_argument("--batch-ms", type=float, default=4.0, help="approximate duration of one round's batch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    ao_version, ao_int8, ao_int4 = load_torchao()
    have_ao = ao_version is not None
    print(f"torch {torch.__version__}, {args.threads} thread(s), torchao {ao_version if have_ao else 'not installed'}")
    if not have_ao:
        print(f"torchao not installed ({ao_int8}); torchao columns skipped")

    cols = ["bf16 F.linear", "ours int8", "ao int8", "ours int4", "ao int4"]
    if not have_ao:
        cols = [c for c in cols if not c.startswith("ao")]
    print(f"\n| weight (out x in) | tokens | {' | '.join(c + ' µs' for c in cols)} | int8 faster | int4 faster |")
    print("|---|---|" + "---|" * len(cols) + "---|---|")
    errors = []
    with torch.inference_mode():
        for out_f, in_f in SHAPES:
            linear = nn.Linear(in_f, out_f, bias=False)
            nn.init.normal_(linear.weight, std=0.02)
            linear = linear.to(torch.bfloat16)
            w = linear.weight
            modules = {
                "ours int8": Int8Linear.from_linear(linear),
                "ours int4": Int4Linear.from_linear(linear, GROUP_SIZE),
            }
            if have_ao:
                modules["ao int8"] = torchao_linear(linear, ao_int8)
                modules["ao int4"] = torchao_linear(linear, ao_int4)

            x = torch.randn(32, in_f, dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            errors.append((f"{out_f}x{in_f}", {n: rel_err(modules[n](x), ref) for n in cols if n in modules}))
            errors[-1][1]["bf16 F.linear"] = rel_err(F.linear(x, w), ref)

            for tokens in TOKENS:
                xt = torch.randn(tokens, in_f, dtype=torch.bfloat16)
                methods = {"bf16 F.linear": lambda xt=xt, w=w: F.linear(xt, w)}
                methods.update({n: (lambda m=m, xt=xt: m(xt)) for n, m in modules.items()})
                us = time_methods({n: methods[n] for n in cols}, args.rounds, args.batch_ms)
                int8 = faster("ours", us["ours int8"], "torchao", us.get("ao int8"))
                int4 = faster("ours", us["ours int4"], "torchao", us.get("ao int4"))
                cells = " | ".join(f"{us[c]:.0f}" for c in cols)
                print(f"| {out_f}x{in_f} | {tokens} | {cells} | {int8} | {int4} |", flush=True)

    print("\nmax |y - ref| / max |ref| at 32 tokens (ref: fp32 matmul of the bf16 weight and input)\n")
    print(f"| weight (out x in) | {' | '.join(cols)} |\n|---|" + "---|" * len(cols))
    for shape, err in errors:
        print(f"| {shape} | {' | '.join(f'{err[c]:.4f}' for c in cols)} |")


if __name__ == "__main__":
    main()
