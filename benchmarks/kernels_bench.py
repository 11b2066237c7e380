"""Kernel micro-benchmarks behind design choices, each set measured side by side in one run:

linear:    the engine's bf16 linear (PackedLinear, tachyllm/kernels/linear.py) vs plain F.linear,
           at the default model's shapes and 1 / 64 / 512 tokens.
attention: the C++ paged attention kernel (kernels/csrc/attention.cpp) vs the PyTorch path's tiled
           causal grouped matmul vs F.scaled_dot_product_attention (bf16, 9 query heads, 3 KV
           heads, head_dim 64): a batch of decodes, a verification, prefill chunks; the kernel
           also with K/V from DRAM (a different cache copy each call), as in an engine step.
quant:     the C++ block kernels (kernels/csrc/quant_gemv.cpp; 16- and 8-bit activations) vs aten's
           int4 kernel (group 32) vs the engine's bf16 linear (PackedLinear), at the default model's
           Q4_1 shapes, and
           the Q8_0 LM head vs bf16, at 1 / 4 / 16 / 64 rows. Each call reads a different copy of
           the weights (>= 128 MB in all) so that they come from DRAM, as in a decode step, not
           from the 32 MiB L3; times are the best of 5 runs. GB/s = packed weight bytes / time.
kquant:    the C++ block kernels on each GGUF block type a Q4_K_M file holds (Q4_K, Q5_K, Q6_K,
           Q5_0, Q8_0; Q4_1 for reference) vs the engine's bf16 linear (PackedLinear) on the
           dequantized weight, at Qwen2.5-1.5B's shapes (gate_up 17920 x 1536, down 1536 x 8960)
           and 1 / 5 (a 4-draft verification) / 16 / 64 rows, weights from DRAM as in quant. GB/s = tile
           bytes / time. --kquant-types / --kquant-rows / --kquant-no-bf16 narrow it, e.g. to time two
           checkouts' kernels against each other (this script, run with PYTHONPATH=<checkout> from
           inside that checkout: each builds its own kernels):

    cd <checkout> && PYTHONPATH=. <this repo>/.venv/bin/python <this repo>/benchmarks/kernels_bench.py \
        --threads 2 --kquant-types Q4_K,Q6_K --kquant-rows 1,5,64 --kquant-no-bf16 kquant
sampling:  drawing a token per row from 64 x 49,152 probabilities: the sampler's CDF inversion vs
           the exponential race it replaced.
lora:      the LoRA segment kernel (kernels/csrc/lora.cpp, LoRASlots.apply) at the default model's four
           wrapped linears (q/k/v, o, gate/up, down), rank 16 on all seven projections, bf16 weights and
           activations: one decode row of one adapter, and 64 rows over 8 adapters, each call on the
           next linear of 30 layers as in a decode step (the adapter weights from L3, not L1/L2).
           GB/s = adapter bytes read / time. To time two checkouts' kernels against each other, run
           it from each as for kquant.
bf16:      the C++ bf16 matrix-vector kernel (kernels/csrc/bf16_gemv.cpp) vs the oneDNN-prepacked
           weight vs F.linear, at the default model's shapes and 1 / 4 / 16 / 64 / 512 rows (the
           LM head up to 64), weights from DRAM as in quant. GB/s = weight bytes / time.

    .venv/bin/python benchmarks/kernels_bench.py --threads 1
    .venv/bin/python benchmarks/kernels_bench.py --threads 2 quant
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from tachyllm.backends import create_backend
from tachyllm.backends.torch_backend import causal_attention
from tachyllm.kernels.linear import NATIVE_MAX_ROWS, PackedLinear, onednn_packing_available, packing_available
from tachyllm.kernels.native import native_ops
from tachyllm.quantization.int4 import quantize_int4


def per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _engine_bf16_kernels():
    """The bf16 kernel the engine's PackedLinear gets here (None: oneDNN's packed weight)."""
    return create_backend("auto", torch.device("cpu")).bf16_linear_kernels()


def bench_linear() -> None:
    print("| weight (out x in) | tokens | F.linear µs | packed µs | ratio |\n|---|---|---|---|---|")
    for out_f, in_f in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:
        linear = torch.nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
        packed = PackedLinear(linear, _engine_bf16_kernels())
        for tokens in (1, 64, 512):
            x = torch.randn(tokens, in_f, dtype=torch.bfloat16)
            calls = 10 if out_f * tokens > 10**6 else 100
            plain = per_call_us(lambda: F.linear(x, linear.weight), calls)
            fast = per_call_us(lambda: packed(x), calls)
            print(f"| {out_f}x{in_f} | {tokens} | {plain:.0f} | {fast:.0f} | {plain / fast:.2f}x |")


def _paged(tokens: list[int], kv_heads: int = 3, head_dim: int = 64, block_size: int = 16):
    """A bf16 paged cache holding each sequence's `tokens` positions in shuffled blocks."""
    widths = [-(-t // block_size) for t in tokens]
    order = torch.randperm(sum(widths)).to(torch.int32)
    tables = torch.zeros(len(tokens), max(widths), dtype=torch.int32)
    for i, start in enumerate([sum(widths[:i]) for i in range(len(tokens))]):
        tables[i, : widths[i]] = order[start : start + widths[i]]
    shape = (sum(widths), block_size, kv_heads, head_dim)
    return torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16), tables


def bench_attention() -> None:
    """Per layer (9 query heads, 3 KV heads, head_dim 64, bf16): prefill shapes against SDPA and the
    grouped-matmul path over contiguous K/V, and the C++ kernel reading a paged cache: the same cache
    every call (in cache, like the other columns), and one of several copies (>= 128 MB in all) in
    turn, so that K/V come from DRAM as in an engine step, whose 30 layers' caches never fit in L3."""
    ops = native_ops()
    print(
        "\n| shape | SDPA ms | grouped matmul ms | C++ paged kernel ms | kernel, K/V from DRAM ms | kernel vs grouped |"
        "\n|---|---|---|---|---|---|"
    )
    # (sequences, queries each, cached tokens before them)
    for seqs, length, cached in [(64, 1, 200), (1, 5, 300), (1, 16, 4080), (1, 512, 0), (1, 2048, 0)]:
        q = torch.randn(seqs * length, 9, 64, dtype=torch.bfloat16)
        k = torch.randn(cached + length, 3, 64, dtype=torch.bfloat16)
        v = torch.randn(cached + length, 3, 64, dtype=torch.bfloat16)
        calls = 3 if length * (cached + length) > 10**5 else 20
        ref = grouped = float("nan")
        if seqs == 1:
            mask = torch.arange(cached + length)[None] <= torch.arange(cached, cached + length)[:, None]
            qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

            def sdpa():
                if cached:
                    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=0.125)
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True, scale=0.125)

            ref = per_call_us(sdpa, calls) / 1e3
            grouped = per_call_us(lambda: causal_attention(q, k, v, cached, 0.125), calls) / 1e3
        kernel = from_dram = float("nan")
        if ops is not None:
            k_cache, v_cache, tables = _paged([cached + length] * seqs)
            info = torch.tensor([[i * length, length, cached] for i in range(seqs)], dtype=torch.int32)
            out = torch.empty_like(q)
            kernel = (
                per_call_us(lambda: ops.paged_attention(out, q, k_cache, v_cache, tables, info, 0.125), calls) / 1e3
            )
            caches = list(zip(_copies(k_cache, 64e6), _copies(v_cache, 64e6)))
            from_dram = (
                best_us(
                    [lambda c=c: ops.paged_attention(out, q, c[0], c[1], tables, info, 0.125) for c in caches],
                    len(caches),
                )
                / 1e3
            )
        name = f"{seqs} x {length} queries after {cached} tokens"
        print(f"| {name} | {ref:.2f} | {grouped:.2f} | {kernel:.2f} | {from_dram:.2f} | {grouped / kernel:.1f}x |")


def best_us(fns: list, calls: int, runs: int = 5) -> float:
    """Best per-call time over `runs`, each call on the next of `fns` (one per weight copy)."""
    for fn in fns[: max(2, min(len(fns), calls))]:  # a first pass: the first run measured is no colder
        fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for i in range(calls):
            fns[i % len(fns)]()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def _copies(t: torch.Tensor, total: float = 128e6) -> list[torch.Tensor]:
    return [t.clone() for _ in range(max(2, int(total // (t.numel() * t.element_size()))))]


def _bf16_linears(out_f: int, in_f: int, total: float = 128e6) -> list[torch.nn.Module]:
    """The engine's bf16 linear, each on its own weight (it may not copy it): PackedLinear, or the
    plain nn.Linear where neither the vectorized C++ kernel nor oneDNN's bf16 packing exists."""
    count = max(2, int(total // (out_f * in_f * 2)))
    kernels = _engine_bf16_kernels()
    linears = [torch.nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16) for _ in range(count)]
    if not packing_available(torch.bfloat16, kernels):
        return linears
    return [PackedLinear(linear, kernels) for linear in linears]


QUANT_ROWS = (1, 4, 16, 64)


def bench_quant() -> None:
    ops = native_ops()
    if ops is None:
        print("\nquant: C++ kernels unavailable, skipped")
        return
    print(f"\nC++ block kernels: {ops.quant_gemv_isa()}")
    print(
        "| weight (out x in) | rows | native 16-bit µs | native 8-bit µs | aten int4 µs | bf16 linear µs | "
        "native vs aten | native vs bf16 |\n"
        "|---|---|---|---|---|---|---|---|"
    )  # fmt: skip
    torch.manual_seed(0)
    for out_f, in_f in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        w = quantize_int4(torch.randn(out_f, in_f) * 0.02, 32)
        blocks = _copies(ops.quant_pack_q4_1(w.codes, w.scales, w.mins))
        aten_w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.int(), 1)
        zeros = torch.stack([w.scales, w.mins + 8 * w.scales], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        aten = list(zip(_copies(aten_w), _copies(zeros)))
        packed = _bf16_linears(out_f, in_f)
        for rows in QUANT_ROWS:
            x = torch.randn(rows, in_f, dtype=torch.bfloat16)
            calls = 200 if rows <= 4 else 40
            t16, t8 = (
                best_us([lambda b=b: ops.quant_gemv_q4_1(x, b, out_f, bits) for b in blocks], calls) for bits in (16, 8)
            )
            ta = best_us(
                [lambda a=a: torch.ops.aten._weight_int4pack_mm_for_cpu(x, a[0], 32, a[1]) for a in aten], calls
            )
            tb = best_us([lambda p=p: p(x) for p in packed], calls)
            gbs = f" ({blocks[0].numel() / t16 / 1e3:.0f} GB/s)" if rows == 1 else ""
            print(
                f"| {out_f}x{in_f} Q4_1 | {rows} | {t16:.1f}{gbs} | {t8:.1f} | {ta:.1f} | {tb:.1f} | "
                f"{ta / t16:.1f}x | {tb / t16:.1f}x |"
            )
    out_f, in_f = 49152, 576  # the tied LM head, Q8_0 in the default GGUF
    codes = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8)
    scales = torch.rand(out_f, in_f // 32).mul(0.01).half().float()
    blocks = _copies(ops.quant_pack_q8_0(codes, scales))
    packed = _bf16_linears(out_f, in_f)
    for rows in QUANT_ROWS:
        x = torch.randn(rows, in_f, dtype=torch.bfloat16)
        calls = 20 if rows <= 4 else 5
        t16, t8 = (
            best_us([lambda b=b: ops.quant_gemv_q8_0(x, b, out_f, bits) for b in blocks], calls) for bits in (16, 8)
        )
        tb = best_us([lambda p=p: p(x) for p in packed], calls)
        gbs = f" ({blocks[0].numel() / t16 / 1e3:.0f} GB/s)" if rows == 1 else ""
        print(f"| {out_f}x{in_f} Q8_0 head | {rows} | {t16:.0f}{gbs} | {t8:.0f} | - | {tb:.0f} | - | {tb / t16:.1f}x |")


KQUANT_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q8_0, T.Q4_1)
KQUANT_ROWS = (1, 5, 16, 64)


def bench_kquant(
    kinds: tuple[T, ...] = KQUANT_TYPES, row_counts: tuple[int, ...] = KQUANT_ROWS, bf16: bool = True
) -> None:
    ops = native_ops()
    if ops is None:
        print("\nkquant: C++ kernels unavailable, skipped")
        return
    print(
        "\n| weight (out x in) | type | rows | native 16-bit µs | native 8-bit µs | bf16 linear µs | "
        "native vs bf16 |\n|---|---|---|---|---|---|---|"
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for out_f, in_f in [(17920, 1536), (1536, 8960)]:
        packed = _bf16_linears(out_f, in_f) if bf16 else None
        for kind in kinds:
            block, size = GGML_QUANT_SIZES[kind]
            # Bytes below 0x3C: every fp16 scale finite and normal (the codes' values do not matter here).
            raw = torch.from_numpy(rng.integers(0, 0x3C, (out_f, in_f // block * size), dtype=np.uint8))
            tiles = _copies(ops.quant_pack_gguf(int(kind), raw, in_f))
            layout = torch.tensor([[int(kind), out_f]])
            for rows in row_counts:
                x = torch.randn(rows, in_f, dtype=torch.bfloat16)
                calls = 50 if rows == 1 else 10
                t16, t8 = (
                    best_us([lambda t=t: ops.quant_gemv(x, t, layout, bits) for t in tiles], calls) for bits in (16, 8)
                )
                tb = best_us([lambda p=p: p(x) for p in packed], calls) if bf16 else float("nan")
                gbs = f" ({tiles[0].numel() / t16 / 1e3:.0f} GB/s)" if rows == 1 else ""
                name = f"{out_f}x{in_f} | {kind.name}"
                print(f"| {name} | {rows} | {t16:.0f}{gbs} | {t8:.0f} | {tb:.0f} | {tb / t16:.1f}x |", flush=True)


BF16_ROWS = (1, 4, 16, 64, 512)


def bench_bf16() -> None:
    ops = native_ops()
    if ops is None:
        print("\nbf16: C++ kernels unavailable, skipped")
        return
    if not onednn_packing_available(torch.bfloat16):
        print("\nbf16: oneDNN packs no bf16 here, skipped (benchmarks/bf16_linear_bench.py compares F.linear)")
        return
    print(f"\nbf16 kernel: {ops.bf16_linear_isa}; PackedLinear uses it up to {NATIVE_MAX_ROWS} rows")
    print(
        "| weight (out x in) | rows | native µs | oneDNN packed µs | F.linear µs | "
        "packed / native | F.linear / native |\n"
        "|---|---|---|---|---|---|---|"
    )  # fmt: skip
    torch.manual_seed(0)
    for out_f, in_f in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]:
        weights = _copies(torch.randn(out_f, in_f, dtype=torch.bfloat16))
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        for rows in BF16_ROWS:
            if out_f * rows > 49152 * 64:  # the LM head at 512 rows: seconds, and it never sees that many
                continue
            x = torch.randn(rows, in_f, dtype=torch.bfloat16)
            calls = max(3, min(200, int(0.02 / (out_f * in_f * (2 / 20e9 + rows * 2 / 1e11)))))  # ~20 ms a run
            tn = best_us([lambda w=w: ops.bf16_linear(x, w) for w in weights], calls)
            onednn = [lambda p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]
            tp = best_us(onednn, calls)
            tf = best_us([lambda w=w: F.linear(x, w) for w in weights], calls)
            gbs = f" ({weights[0].numel() * 2 / tn / 1e3:.0f} GB/s)" if rows == 1 else ""
            ratios = f"{tp / tn:.2f}x | {tf / tn:.2f}x"
            print(f"| {out_f}x{in_f} | {rows} | {tn:.0f}{gbs} | {tp:.0f} | {tf:.0f} | {ratios} |")


LORA_RANK, LORA_LAYERS = 16, 30
# The default model's wrapped linears: (input features, output columns of each fused projection).
LORA_LINEARS = {"qkv": (576, [576, 192, 192]), "o": (576, [576]), "gate_up": (576, [1536, 1536]), "down": (1536, [576])}


def _lora_slots(ops, in_f: int, outs: list[int], adapters: int) -> tuple[object, int]:
    """One linear's LoRASlots with `adapters` random rank-16 bf16 adapters in slots 1.., and the bytes
    of one adapter's A and B."""
    slots = ops.LoRASlots()
    layout = torch.tensor([[sum(outs[:p]), n, p * LORA_RANK, LORA_RANK] for p, n in enumerate(outs)])
    for slot in range(1, adapters + 1):
        a = torch.randn(LORA_RANK * len(outs), in_f).bfloat16()
        bt = (torch.randn(LORA_RANK * sum(outs)) * 0.01).bfloat16()
        slots.set(slot, a, bt, layout)
    return slots, 2 * LORA_RANK * (len(outs) * in_f + sum(outs))


def bench_lora() -> None:
    ops = native_ops()
    if ops is None:
        print("\nlora: C++ kernels unavailable, skipped")
        return
    print(
        f"\nLoRA kernel, rank {LORA_RANK} bf16, each call on the next of {len(LORA_LINEARS)} x {LORA_LAYERS} linears\n"
        "| step | linear | µs per call | GB/s |\n|---|---|---|---|"
    )  # fmt: skip
    torch.manual_seed(0)
    for rows, adapters in ((1, 1), (64, 8)):
        step = ops.LoRAStep()
        if adapters == 1:
            step.set(None, [0, rows], [1])
        else:  # rows interleaved over the adapters, as a batch of requests arrives; grouped by slot
            per = rows // adapters
            order = [r for slot in range(adapters) for r in range(slot, rows, adapters)]
            step.set(torch.tensor(order), [i * per for i in range(adapters + 1)], list(range(1, adapters + 1)))
        total_us = 0.0
        for name, (in_f, outs) in LORA_LINEARS.items():
            layers = [_lora_slots(ops, in_f, outs, adapters) for _ in range(LORA_LAYERS)]
            x = torch.randn(rows, in_f).bfloat16()
            out = torch.zeros(rows, sum(outs)).bfloat16()
            us = best_us([lambda s=s: s.apply(out, x, step) for s, _ in layers], 4 * LORA_LAYERS)
            total_us += us
            gbs = layers[0][1] * adapters / us / 1e3
            print(f"| {rows} rows, {adapters} adapters | {name} | {us:.1f} | {gbs:.0f} |")
        print(f"| {rows} rows, {adapters} adapters | a step ({LORA_LAYERS} layers) | {total_us * LORA_LAYERS:.0f} | |")


def bench_sampling() -> None:
    """Drawing one token per row from a [64, 49152] distribution: the sampler's CDF inversion (one
    uniform per row) against the exponential race it replaced (argmax of p / E, E ~ Exp(1) for
    every vocabulary entry)."""
    from tachyllm.sampling.sampler import Sampler

    sampler = Sampler(49152, [], torch.device("cpu"), seed=0)
    probs = torch.softmax(torch.randn(64, 49152) * 3, dim=-1)
    seqs = [type("Row", (), {"generator": None})() for _ in range(64)]
    generator = torch.Generator().manual_seed(0)

    def race():
        return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)

    inversion = per_call_us(lambda: sampler.draw(probs, seqs), 20) / 1e3
    exponential = per_call_us(race, 20) / 1e3
    print("\n| draw, 64 rows x 49,152 | CDF inversion ms | exponential race ms | ratio |\n|---|---|---|---|")
    print(f"| one token per row | {inversion:.2f} | {exponential:.2f} | {exponential / inversion:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kquant-types", default=",".join(k.name for k in KQUANT_TYPES), help="kquant: block types")
    ap.add_argument("--kquant-rows", default=",".join(map(str, KQUANT_ROWS)), help="kquant: activation row counts")
    ap.add_argument("--kquant-no-bf16", action="store_true", help="kquant: skip the bf16 linear column")
    ap.add_argument("sections", nargs="*", help="linear, attention, quant, kquant, bf16, lora, sampling (default: all)")
    args = ap.parse_args()
    args.sections = args.sections or ["linear", "attention", "quant", "kquant", "bf16", "lora", "sampling"]
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    with torch.inference_mode():
        if "linear" in args.sections:
            bench_linear()
        if "attention" in args.sections:
            bench_attention()
        if "quant" in args.sections:
            bench_quant()
        if "kquant" in args.sections:
            kinds = tuple(T[name] for name in args.kquant_types.split(","))
            bench_kquant(kinds, tuple(int(r) for r in args.kquant_rows.split(",")), not args.kquant_no_bf16)
        if "bf16" in args.sections:
            bench_bf16()
        if "lora" in args.sections:
            bench_lora()
        if "sampling" in args.sections:
            bench_sampling()


if __name__ == "__main__":
    main()
