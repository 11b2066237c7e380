"""Weights on transparent huge pages vs on malloc's 4 KiB pages, side by side in one process.

Two engines of the same model are built, one with tachyllm/huge_pages.py switched off; each round
gives both the same number of requests, prefills them, and then alternates their decode steps one by
one, so both see the same host noise. Prints each round's median decode step and the ratio, and the
process's AnonHugePages.

    .venv/bin/python benchmarks/huge_pages_ab.py --model /work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --quantization gguf --batch-sizes 1,64 --rounds 4 [--order huge-first]
    .venv/bin/python benchmarks/huge_pages_ab.py --model /work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --quantization gguf --packed-layers-only 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import numpy as np
import torch
from torch import nn

from tachyllm import LLM, SamplingParams, huge_pages
from tachyllm.bench.datasets import random_token_ids
from tachyllm.quantization.gguf_packed import GGUFLinear


def anon_huge_mib() -> float:
    with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


def packed_layers_only(options: dict, pairs: int) -> None:
    """Every GGUFLinear's one-row product on its packed weights where loading left them (4 KiB pages)
    and on a copy moved onto huge pages, the whole model's layers in turn, alternated `pairs` times."""
    with mock.patch.object(huge_pages, "available", return_value=False):
        llm = LLM(**options)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, GGUFLinear)]
    if not layers:
        raise SystemExit("no GGUFLinear layers: use a GGUF model with --quantization gguf")
    holder = nn.Module()
    holder.copies = [layer.packed.clone() for layer in layers]
    huge_pages.move_weights(holder)
    inputs = [torch.randn(1, layer.in_features) for layer in layers]

    def seconds(buffers: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for layer, packed, x in zip(layers, buffers, inputs):
            layer._gemv(x, packed, layer.layout, layer.activation_bits)
        return time.perf_counter() - start

    small, huge, ratios = [], [], []
    for i in range(pairs):
        if i % 2:
            b, a = seconds(holder.copies), seconds([layer.packed for layer in layers])
        else:
            a, b = seconds([layer.packed for layer in layers]), seconds(holder.copies)
        small.append(a)
        huge.append(b)
        ratios.append(a / b)
    q = statistics.quantiles(ratios, n=10)
    print(
        f"{len(layers)} packed layers, one row: 4 KiB pages {statistics.median(small) * 1e3:.2f} ms, huge pages "
        f"{statistics.median(huge) * 1e3:.2f} ms (medians); speed-up median {statistics.median(ratios):.3f}, "
        f"p10 {q[0]:.3f}, p90 {q[-1]:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--quant-activation-bits", type=int, default=None, help="default: the engine's rule")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--order", choices=("small-first", "huge-first"), default="small-first")
    parser.add_argument(
        "--packed-layers-only", type=int, metavar="PAIRS", default=0,
        help="instead: time the GGUF / int4 packed layers' one-row products alone, PAIRS alternations",
    )  # fmt: skip
    args = parser.parse_args()

    options = dict(
        model=args.model, quantization=args.quantization, quant_activation_bits=args.quant_activation_bits,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.input_len + args.output_len + 16,
    )  # fmt: skip
    if args.packed_layers_only:
        packed_layers_only(options, args.packed_layers_only)
        return

    def small_pages_engine() -> LLM:
        with mock.patch.object(huge_pages, "available", return_value=False):
            return LLM(**options)

    # The engine built first gets the fresher memory: --order says which.
    if args.order == "small-first":
        small_pages, huge = small_pages_engine(), LLM(**options)
    else:
        huge, small_pages = LLM(**options), small_pages_engine()
    print(f"AnonHugePages with both engines built ({args.order}): {anon_huge_mib():.0f} MiB")
    engines = {"4 KiB pages": small_pages.engine, "huge pages": huge.engine}
    rng = np.random.default_rng(0)
    tokenizer = huge.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ratios = []
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, engine in engines.items():
                for i in range(batch):
                    engine.add_request(f"{r}-{i}", random_token_ids(tokenizer, args.input_len, rng), params)
                scheduler = engine.scheduler
                while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
                    engine.step()  # prefill, not timed
            steps: dict[str, list[float]] = {name: [] for name in engines}
            # Decode steps alternate one by one (and which engine goes first alternates too), so that
            # both see the host's load alike.
            order = list(engines.items())
            while any(engine.has_unfinished_requests() for engine in engines.values()):
                for name, engine in order:
                    if engine.has_unfinished_requests():
                        t0 = time.perf_counter()
                        engine.step()
                        steps[name].append(time.perf_counter() - t0)
                order.reverse()
            if r == 0:
                continue
            medians = {name: statistics.median(times) * 1e3 for name, times in steps.items()}
            ratio = medians["4 KiB pages"] / medians["huge pages"]
            ratios.append(ratio)
            print(
                f"batch {batch:3d} round {r}: decode step 4 KiB pages {medians['4 KiB pages']:7.2f} ms, "
                f"huge pages {medians['huge pages']:7.2f} ms, speed-up {ratio:.3f}"
            )
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(f"batch {batch:3d}: speed-up {spread} (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
