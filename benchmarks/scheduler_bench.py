"""Scheduler benchmarks on the real default model, each comparison measured side by side in one run.

prefix  Shared system prompt (1,024 tokens) + 16 distinct short questions, sent one after another.
        Mean TTFT of requests 2..16 with prefix caching on vs off.
itl     8 streams decoding when a 4,096-token prompt arrives. p99 inter-token latency of the streams
        while the prompt is prefilled vs their p99 with no arrival, with chunked prefill (small
        token budget), with chunks cut by max_decode_slowdown (large budget), and without chunking
        (the whole prompt in one step).
kv      A mixed offline workload (shared-prefix chats and independent prompts of many lengths).
        Per step: cache usage, physical blocks in use / blocks in the live sequences' block tables
        (below 1 when prefix blocks are shared), and tokens stored / token slots of the blocks in use
        (internal fragmentation of the last, partly filled block of each sequence).

    .venv/bin/python benchmarks/scheduler_bench.py                 # all sections, bf16
    .venv/bin/python benchmarks/scheduler_bench.py --quick itl     # shrunk sizes, one section

Timings are wall-clock on whatever else the machine is running; on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from tachyllm import LLM, SamplingParams

RULES = [
    "Customers may return unopened items within {n} days with a receipt.",
    "Aisle {n} holds fasteners sorted by thread size, then by length.",
    "Staff must log every key-cutting order in ledger {n} before closing.",
    "Paint is mixed to order; tint formula {n} is the house white.",
    "Power tools over {n} kilograms ship only by freight.",
    "Garden soil is sold in bags of {n} litres; pallets ship on Tuesdays.",
    "Answer briefly, name the aisle, and never quote a price you did not see in rule {n}.",
]
QUESTIONS = [
    "Where are the wood screws?",
    "Can I return an opened drill?",
    "What is the house white?",
    "How do I order a pallet of soil?",
    "Do you cut keys?",
    "Which aisle has bolts?",
    "Is freight shipping free?",
    "How long is the return window?",
    "Can you mix paint?",
    "Where do I find hinges?",
    "Do you sell garden hoses?",
    "What day do pallets ship?",
    "Can I return paint?",
    "Where are the nails?",
    "Who logs key orders?",
    "How heavy can a parcel be?",
]


def system_prompt(tokenizer, num_tokens: int) -> list[int]:
    rng = random.Random(0)
    text = " ".join(rng.choice(RULES).format(n=rng.randint(1, 99)) for _ in range(num_tokens // 8))
    ids = tokenizer.encode("Store policy:\n" + text)
    assert len(ids) >= num_tokens, "system prompt text too short"
    return ids[:num_tokens]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_llm(args, **options) -> LLM:
    return LLM(args.model, dtype=args.dtype, threads=args.threads, block_size=args.block_size, **options)


# -- prefix caching: TTFT -----------------------------------------------------------------------


def sequential_ttfts(llm: LLM, prompts: list[list[int]]) -> list[float]:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([[17, 18, 19, 20]], params, use_tqdm=False)  # warm-up, shares nothing with the prompts
    return [llm.generate([p], params, use_tqdm=False)[0].metrics.ttft for p in prompts]


def bench_prefix(args) -> list[str]:
    results = {}
    for caching in (True, False):
        llm = make_llm(args, enable_prefix_caching=caching, kv_cache_memory=args.kv_cache_mib << 20)
        tok = llm.get_tokenizer()
        system = system_prompt(tok, args.system_tokens)
        prompts = [
            system + tok.encode(f"\nQuestion: {q}\nAnswer:", add_special_tokens=False)
            for q in QUESTIONS[: args.questions]
        ]
        ttfts = sequential_ttfts(llm, prompts)
        results[caching] = (ttfts, llm.engine.stats)
    on, off = statistics.mean(results[True][0][1:]), statistics.mean(results[False][0][1:])
    stats = results[True][1]
    return [
        f"### Prefix caching: {args.system_tokens}-token system prompt + {args.questions} questions, sequential",
        "",
        "| | caching on | caching off | off / on |",
        "|---|---|---|---|",
        f"| TTFT request 1 (ms) | {1e3 * results[True][0][0]:.1f} | {1e3 * results[False][0][0]:.1f} | |",
        f"| mean TTFT requests 2..{args.questions} (ms) | {1e3 * on:.1f} | {1e3 * off:.1f} | **{off / on:.1f}x** |",
        f"| prefix-cache hit rate (tokens) | "
        f"{100 * stats.prefix_cache_hits / stats.prefix_cache_queries:.1f}% | 0% | |",
    ]


# -- chunked prefill: inter-token latency ---------------------------------------------------------


@dataclass
class ItlRun:
    gaps: list[float]  # seconds between consecutive tokens of the decoding streams
    ttft: float | None  # of the long prompt, when it arrived
    steps: int


def stream_gaps(llm: LLM, streams: list[list[int]], long_prompt: list[int] | None, warmup: int, steps: int) -> ItlRun:
    """Streams decode `warmup` steps, then either the long prompt arrives and gaps are recorded until
    its first token, or (no prompt) gaps are recorded for `steps` steps."""
    eng = llm.engine
    ids = [f"s{i}" for i in range(len(streams))]
    for request_id, prompt in zip(ids, streams):
        # As long as the context allows: the streams are aborted once the measurement ends.
        params = SamplingParams(max_tokens=eng.max_model_len - len(prompt), temperature=0, ignore_eos=True)
        eng.add_request(request_id, prompt, params)
    for _ in range(warmup):
        eng.step()
    now = time.perf_counter()
    last = dict.fromkeys(ids, now)  # time of each stream's latest token
    if long_prompt is not None:
        arrival = now
        eng.add_request("long", long_prompt, SamplingParams(max_tokens=1))
    gaps: list[float] = []
    ttft = None
    count = 0
    while ttft is None and (long_prompt is not None or count < steps):
        outputs = eng.step()
        now = time.perf_counter()
        count += 1
        for out in outputs:
            if out.request_id == "long":
                ttft = now - arrival
            else:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    for request_id in ids:
        eng.abort_request(request_id)
    return ItlRun(gaps, ttft, count)


def bench_itl(args) -> list[str]:
    rng = random.Random(1)
    rows = []
    configs = [
        (f"chunked, budget {args.chunk_budget} tokens", {"max_num_batched_tokens": args.chunk_budget}),
        (
            f"chunked, budget {args.slowdown_budget} tokens, max_decode_slowdown {args.max_decode_slowdown:g}",
            {"max_num_batched_tokens": args.slowdown_budget, "max_decode_slowdown": args.max_decode_slowdown},
        ),
        (
            "not chunked (whole prompt in one step)",
            {"enable_chunked_prefill": False, "max_num_batched_tokens": args.long_prompt + args.streams},
        ),
    ]
    for name, options in configs:
        llm = make_llm(args, kv_cache_memory=args.kv_cache_mib << 20, **options)
        vocab = llm.engine.model_config.vocab_size
        streams = [[rng.randrange(100, vocab) for _ in range(32)] for _ in range(args.streams)]
        long_prompt = [rng.randrange(100, vocab) for _ in range(args.long_prompt)]
        stream_gaps(llm, streams, None, 2, 4)  # warm-up
        base = stream_gaps(llm, streams, None, args.warmup_steps, args.baseline_steps)
        hit = stream_gaps(llm, streams, long_prompt, args.warmup_steps, 0)
        rows.append((name, base, hit))
    lines = [
        f"### Chunked prefill: {args.streams} decoding streams, a {args.long_prompt}-token prompt arrives",
        "",
        (
            "| | p50 ITL no arrival (ms) | p99 ITL no arrival (ms) | p99 ITL during arrival (ms) "
            "| max ITL during arrival (ms) | during / without (p99) | long prompt TTFT (s) | steps of the arrival |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, base, hit in rows:
        p99_base, p99_hit = percentile(base.gaps, 0.99), percentile(hit.gaps, 0.99)
        lines.append(
            f"| {name} | {1e3 * percentile(base.gaps, 0.5):.1f} | {1e3 * p99_base:.1f} | {1e3 * p99_hit:.1f} | "
            f"{1e3 * max(hit.gaps):.1f} | **{p99_hit / p99_base:.2f}x** | {hit.ttft:.2f} | {hit.steps} |"
        )
    return lines


# -- KV-memory utilisation ------------------------------------------------------------------------


@dataclass
class KvSample:
    usage: float  # blocks in use / all blocks
    sharing: float  # blocks in use / blocks in live block tables
    filled: float  # tokens stored / token slots of the blocks in use


def kv_sample(llm: LLM) -> KvSample | None:
    bm = llm.engine.block_manager
    bs = bm.block_size
    live = llm.engine.scheduler.running
    fill: dict[int, int] = {}  # physical block -> tokens with KV in it
    for seq in live:
        for i, block_id in enumerate(seq.block_table):
            fill[block_id] = max(fill.get(block_id, 0), min(bs, seq.num_computed_tokens - i * bs))
    logical = sum(len(s.block_table) for s in live)
    if not fill:
        return None
    return KvSample(len(fill) / bm.num_blocks, len(fill) / logical, sum(fill.values()) / (len(fill) * bs))


def mixed_workload(tok, vocab: int, count: int, rng: random.Random) -> tuple[list[list[int]], list[SamplingParams]]:
    """Half chats under one 512-token system prompt, half independent prompts of 32..768 tokens;
    outputs of 16..256 tokens."""
    system = system_prompt(tok, 512)
    prompts, params = [], []
    for i in range(count):
        if i % 2 == 0:
            question = rng.choice(QUESTIONS) + " " + " ".join(rng.choice(QUESTIONS) for _ in range(rng.randint(0, 4)))
            prompts.append(system + tok.encode(f"\nQuestion: {question}\nAnswer:", add_special_tokens=False))
        else:
            prompts.append([rng.randrange(100, vocab) for _ in range(int(32 * 24 ** rng.random()))])
        params.append(SamplingParams(max_tokens=int(16 * 16 ** rng.random()), temperature=0, ignore_eos=True))
    return prompts, params


def bench_kv(args) -> list[str]:
    lines = [
        f"### KV-memory utilisation: mixed workload of {args.kv_requests} requests, {args.kv_util_cache_mib} MiB cache",
        "",
        (
            "| block size | cache (tokens) | mean cache usage | peak cache usage | blocks in use / blocks in tables "
            "(mean) | tokens stored / slots in use (mean) | same, at peak usage | preemptions | prefix hit rate |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for block_size in args.kv_block_sizes:
        llm = LLM(args.model, dtype=args.dtype, threads=args.threads, block_size=block_size,
                  kv_cache_memory=args.kv_util_cache_mib << 20)  # fmt: skip
        eng = llm.engine
        prompts, params = mixed_workload(
            llm.get_tokenizer(), eng.model_config.vocab_size, args.kv_requests, random.Random(2)
        )
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            eng.add_request(f"m{i}", prompt, p)
        samples = []
        while eng.has_unfinished_requests():
            eng.step()
            sample = kv_sample(llm)
            if sample is not None:
                samples.append(sample)
        peak = max(samples, key=lambda s: s.usage)
        stats = eng.stats
        lines.append(
            f"| {block_size} | {eng.block_manager.num_blocks * block_size} | "
            f"{100 * statistics.mean(s.usage for s in samples):.1f}% | {100 * peak.usage:.1f}% | "
            f"{statistics.mean(s.sharing for s in samples):.3f} | "
            f"{100 * statistics.mean(s.filled for s in samples):.1f}% | "
            f"{100 * peak.filled:.1f}% | {stats.num_preemptions} | "
            f"{100 * stats.prefix_cache_hits / stats.prefix_cache_queries:.1f}% |"
        )
    return lines


SECTIONS = {"prefix": bench_prefix, "itl": bench_itl, "kv": bench_kv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sections", nargs="*", help=f"any of {', '.join(SECTIONS)} (default: all)")
    ap.add_argument("--model", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-mib", type=int, default=512)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=4096)
    ap.add_argument("--chunk-budget", type=int, default=24, help="max_num_batched_tokens of the chunked run")
    ap.add_argument("--max-decode-slowdown", type=float, default=2.0, help="of the run with the latency-aware cap")
    ap.add_argument("--slowdown-budget", type=int, default=512, help="max_num_batched_tokens of the capped run")
    ap.add_argument("--warmup-steps", type=int, default=8)
    # About as many steps as an arrival takes, so that both p99s come from samples of one size.
    ap.add_argument("--baseline-steps", type=int, default=512)
    ap.add_argument("--kv-requests", type=int, default=48)
    ap.add_argument(
        "--kv-util-cache-mib", type=int, default=192, help="KV cache of the kv section (pressure on purpose)"
    )
    ap.add_argument("--kv-block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16])
    ap.add_argument("--quick", action="store_true", help="shrink every workload for a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.system_tokens, args.questions, args.long_prompt = 256, 4, 512
        args.baseline_steps, args.kv_requests, args.kv_util_cache_mib = 16, 8, 64
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")

    print(
        f"default model, dtype {args.dtype}, {args.threads or torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    for name in args.sections or list(SECTIONS):
        start = time.perf_counter()
        print("\n".join(SECTIONS[name](args)))
        print(f"\n({name}: {time.perf_counter() - start:.0f} s)\n")


if __name__ == "__main__":
    main()
