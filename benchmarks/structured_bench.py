"""Structured outputs on the default model, side by side in one process:

1. throughput: 64 concurrent chat requests, 128 output tokens each, all constrained by one JSON schema
   vs the same requests unconstrained; output tokens/s, runs alternating (A B A B ...);
2. time to first token of one request: unconstrained, with a schema never compiled before (cold:
   the compile is part of adding the request) and with the same schema again (cached);
3. per-step mask cost: filling the token bitmasks of 1 and 64 constrained sequences (llguidance), and
   applying them to the logits (Sampler.constrain), in microseconds per step.

    .venv/bin/python benchmarks/structured_bench.py [--rounds 2] [--threads 2] [--quantization gguf] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import uuid

import torch

from tachyllm import LLM, SamplingParams, StructuredOutputsParams
from tachyllm.sampling.sampler import Sampler
from tachyllm.step import SamplingInput
from tachyllm.structured_output.grammar import BitmaskFiller

# Open-ended on purpose (no maxItems): a row stays constrained for all of its 128 tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}},
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "text": {"type": "string", "maxLength": 80}},
                "required": ["n", "text"],
            },
        },
    },
    "required": ["title", "tags", "steps"],
}
TOPICS = ["a picnic", "moving house", "learning the guitar", "a job interview", "baking bread", "a trip to Rome",
          "repairing a bike", "a birthday party"]  # fmt: skip


def prompts(llm: LLM, count: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Plan {TOPICS[i % len(TOPICS)]} (variant {i}) as JSON with steps."}]
        out.append(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))
    return out


def run_batch(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """(seconds, output tokens) of the whole batch, from adding to the last token."""
    engine = llm.engine
    t0 = time.perf_counter()
    for p in batch:
        engine.add_request(uuid.uuid4().hex, p, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
    return time.perf_counter() - t0, tokens


def first_token_seconds(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    engine = llm.engine
    t0 = time.perf_counter()
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    while True:
        if any(out.outputs[0].token_ids for out in engine.step() if out.request_id == request_id):
            elapsed = time.perf_counter() - t0
            engine.abort_request(request_id)
            return elapsed


def mask_costs(llm: LLM, batch_sizes: tuple[int, ...], repeats: int = 50) -> dict[str, float]:
    """µs per step: filling the bitmasks of N grammars partway through the schema, and masking N rows."""
    processor = llm.engine.input_processor
    compiled = processor.grammars.compile(StructuredOutputsParams(json=SCHEMA))
    vocab = processor.limits.vocab_size
    prefix = llm.get_tokenizer().encode('{"title": "A day out", "tags": ["fun", "sun"], "steps": [{"n": 1, "text": "Pa',
                                        add_special_tokens=False)  # fmt: skip
    filler = BitmaskFiller(vocab)
    sampler = Sampler(vocab, llm.engine.eos_token_ids, torch.device("cpu"), seed=0)
    costs = {}
    for n in batch_sizes:
        grammars = [compiled.start() for _ in range(n)]
        for g in grammars:
            for t in prefix:
                assert g.accept(t)
        rows = [(g, [], 1) for g in grammars]
        filler.fill(rows)
        t0 = time.perf_counter()
        for _ in range(repeats):
            masks = filler.fill(rows)
        costs[f"fill_us_batch{n}"] = (time.perf_counter() - t0) / repeats * 1e6
        seqs = [SamplingInput(SamplingParams(temperature=0), [1], 1, token_bitmask=m) for m in masks]
        logits = torch.randn(n, vocab)
        sampler.constrain(logits, seqs)
        t0 = time.perf_counter()
        for _ in range(repeats):
            sampler.constrain(logits, seqs)
        costs[f"apply_us_batch{n}"] = (time.perf_counter() - t0) / repeats * 1e6
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="e.g. gguf: the fast CPU path (C++ kernels)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(max_num_seqs=args.batch, threads=args.threads, dtype=args.dtype, quantization=args.quantization)
    batch = prompts(llm, args.batch)
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    bound = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    run_batch(llm, batch[:4], free)  # warm-up
    run_batch(llm, batch[:4], bound)
    rates: dict[str, list[float]] = {"free": [], "json": []}
    tokens: dict[str, list[int]] = {"free": [], "json": []}
    for r in range(args.rounds):
        for name in ("free", "json") if r % 2 == 0 else ("json", "free"):
            seconds, n = run_batch(llm, batch, free if name == "free" else bound)
            rates[name].append(n / seconds)
            tokens[name].append(n)
            print(f"round {r} {name}: {n} tokens in {seconds:.1f} s = {n / seconds:.1f} tok/s", flush=True)

    ttft: dict[str, list[float]] = {"free": [], "cold": [], "cached": []}
    for i in range(3):
        ttft["free"].append(first_token_seconds(llm, batch[0], free))
        cold_schema = {**SCHEMA, "description": f"never seen before {uuid.uuid4().hex}"}
        cold = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(json=cold_schema))
        ttft["cold"].append(first_token_seconds(llm, batch[0], cold))
        ttft["cached"].append(first_token_seconds(llm, batch[0], cold))
    costs = mask_costs(llm, (1, args.batch))

    ratio = [j / f for j, f in zip(rates["json"], rates["free"])]
    result = {
        "output_tok_s": rates,
        "output_tokens": tokens,
        "json_over_free": ratio,
        "ttft_ms": {k: [round(v * 1000, 1) for v in vs] for k, vs in ttft.items()},
        "mask_costs_us": {k: round(v, 1) for k, v in costs.items()},
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "quantization": args.quantization,
    }
    print(json.dumps(result, indent=1))
    print(
        f"\nconstrained / unconstrained output tok/s: {min(ratio):.3f}-{max(ratio):.3f}; "
        f"TTFT median ms: free {statistics.median(ttft['free']) * 1000:.0f}, "
        f"cold schema {statistics.median(ttft['cold']) * 1000:.0f}, "
        f"cached {statistics.median(ttft['cached']) * 1000:.0f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
