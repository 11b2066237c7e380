"""Quantization side by side on the default model: decode tokens/s at batch 1 and 32, weight
memory, quality against the fp32 reference (tachy eval quality's metrics), and KV-cache capacity.

    .venv/bin/python benchmarks/quantization_bench.py [--threads 2] [--json out.json]

All configurations are measured in one run so that ratios are comparable on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass

from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.eval.greedy import agreement, greedy_tokens
from tachyllm.eval.quality import compare, describe, heldout_windows
from tachyllm.sampling_params import SamplingParams

CONFIGS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(),
    "int8": dict(quantization="int8"),
    "int4": dict(quantization="int4"),
    "awq": dict(quantization="awq"),
    "gguf": dict(quantization="gguf"),
    "bf16+kv fp8": dict(kv_cache_dtype="fp8"),
    "bf16+kv int8": dict(kv_cache_dtype="int8"),
    "int4+kv fp8": dict(quantization="int4", kv_cache_dtype="fp8"),
}
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "Once upon a time",
    "The best way to learn",
]
KV_MEMORY = 256 << 20  # fixed budget for the capacity comparison
LONG_SEQ = 2048


@dataclass
class Row:
    name: str
    config: str
    weight_mib: float
    decode_b1: float
    decode_b32: float
    ppl: float
    top1: float
    kl_mean: float
    kl_p99: float
    kl_max: float
    greedy_agreement: float
    kv_blocks: int
    max_2k_seqs: int


def decode_rate(engine: LLMEngine, batch: int, new_tokens: int) -> float:
    """Generated tokens per second, excluding the first step (prefill of every prompt)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", f"Request {i}: write a short story about the number {i}.", params)
    engine.step()
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.outputs) for o in engine.step())
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="subset of configuration names")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument(
        "--speed-only", action="store_true", help="decode rates only (no quality, greedy or KV capacity)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def build(extra: dict, **kw) -> LLMEngine:
        return LLMEngine(EngineConfig(threads=args.threads, enable_prefix_caching=False, **extra, **kw))

    if not args.speed_only:
        ref_config = EngineConfig(
            dtype="float32", threads=args.threads, max_num_seqs=1, max_model_len=128, enable_prefix_caching=False
        )
        reference = LLMEngine(ref_config)
        windows = heldout_windows(reference, 128)
        greedy_ref = greedy_tokens(reference, GREEDY_PROMPTS, 32)
    rows = []
    for name, extra in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        engine = build(extra, max_num_seqs=32, max_model_len=256)
        b1 = decode_rate(engine, 1, 64)
        b32 = decode_rate(engine, 32, 32)
        if args.speed_only:
            print(
                json.dumps(
                    {"name": name, "weight_mib": engine.weight_bytes / 2**20, "decode_b1": b1, "decode_b32": b32}
                ),
                flush=True,
            )
            continue
        agree = agreement(greedy_tokens(engine, GREEDY_PROMPTS, 32), greedy_ref)
        # Quality last: the teacher-forced pass writes cache slots outside the block manager.
        report = compare(engine, reference, windows, (name, "fp32"))
        blocks = build(extra, kv_cache_memory=KV_MEMORY, max_num_seqs=1, max_model_len=256).block_manager.num_blocks
        rows.append(Row(
            name, describe(engine), engine.weight_bytes / 2**20, b1, b32, report.ppl_config,
            report.top1_agreement, report.kl_mean, report.kl_p99, report.kl_max, agree, blocks,
            blocks * engine.config.block_size // LONG_SEQ,
        ))  # fmt: skip
        print(json.dumps(asdict(rows[-1])), flush=True)

    if args.speed_only:
        return
    print(
        f"\nreference fp32 perplexity {report.ppl_reference:.3f} on {report.num_sequences} "
        "x 128-token held-out sequences"
    )
    print(
        "| config | weights MiB | decode tok/s b=1 | b=32 | ppl | top-1 | KL mean | KL p99 | KL max | greedy agree | "
        "KV blocks @256MiB | 2k-token seqs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.name} | {r.weight_mib:.0f} | {r.decode_b1:.1f} | {r.decode_b32:.1f} | {r.ppl:.3f} | {r.top1:.1%} | "
            f"{r.kl_mean:.4f} | {r.kl_p99:.4f} | {r.kl_max:.4f} | {r.greedy_agreement:.0%} | "
            f"{r.kv_blocks} | {r.max_2k_seqs} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
