"""What tensor parallelism costs where it cannot help (issue #23): the default model (SmolLM2-135M,
bf16) at TP=1 with 2 threads against TP=2 with 1 thread each, on one 2-core host.

For each configuration (alternated over --rounds, the machine being shared):
  - single stream: 128-token prompt, 128 new tokens, output tokens/s;
  - offline batch: 64 prompts x 128 tokens, 128 new tokens each, output tokens/s (prefill included);
  - at TP=2, rank 0's time inside the collectives per step (the all-reduces of the embedding and of
    every layer's attention and MLP outputs, and the LM head's logit gather; waiting for the other
    rank included) and the bytes each step hands to them, per token.
Greedy, EOS ignored. `--allreduce` instead times gloo's all-reduce alone between 2 processes (1 thread
each) at the sizes a step of this model hands it: one decode token (576 bf16 values) and 64 of them.

    PYTHONPATH=. .venv/bin/python benchmarks/tp_bench.py --rounds 2
    PYTHONPATH=. .venv/bin/python benchmarks/tp_bench.py --allreduce
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp

from tachyllm import LLM, SamplingParams
from tachyllm.distributed.group import TPGroup


class CollectiveMeter:
    """Wraps rank 0's collectives (this process) with timers and byte counts."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.bytes = 0
        self.calls = 0
        self._saved = (TPGroup.all_reduce, TPGroup.gather_last_dim)
        meter = self

        def timed(fn):
            def wrapper(group, x):
                t0 = time.perf_counter()
                out = fn(group, x)
                meter.seconds += time.perf_counter() - t0
                meter.bytes += x.numel() * x.element_size()
                meter.calls += 1
                return out

            return wrapper

        TPGroup.all_reduce = timed(TPGroup.all_reduce)
        TPGroup.gather_last_dim = timed(TPGroup.gather_last_dim)

    def reset(self) -> None:
        self.seconds, self.bytes, self.calls = 0.0, 0, 0


def run(llm: LLM, prompts: list[list[int]], meter: CollectiveMeter | None, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    steps0 = llm.engine.stats.num_steps
    if meter is not None:
        meter.reset()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.engine.stats.num_steps - steps0
    row = {"out_tok_s": tokens / seconds, "seconds": seconds, "steps": steps}
    if meter is not None:
        row |= {
            "collective_ms_per_step": 1e3 * meter.seconds / steps,
            "collective_share": meter.seconds / seconds,
            "collective_calls_per_step": meter.calls / steps,
            "collective_bytes_per_token": meter.bytes / (tokens + sum(map(len, prompts))),
        }
    return row


def _allreduce_rank(rank: int, store: str, sizes: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    group = TPGroup.join(store, rank, 2, torch.device("cpu"))
    for numel in sizes:
        x = torch.ones(numel, dtype=torch.bfloat16)
        for _ in range(50):
            group.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(repeats):
            group.all_reduce(x)
        if rank == 0:
            us = 1e6 * (time.perf_counter() - t0) / repeats
            print(json.dumps({"allreduce_bytes": 2 * numel, "us_per_call": round(us, 1)}), flush=True)


def allreduce(repeats: int = 2000) -> None:
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        mp.spawn(_allreduce_rank, args=(store, [576, 64 * 576, 2048 * 576], repeats), nprocs=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (prompts: 128 tokens)")
    parser.add_argument("--allreduce", action="store_true", help="time gloo's all-reduce alone")
    args = parser.parse_args()
    if args.allreduce:
        allreduce()
        return
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(args.batch)]
    meter = CollectiveMeter()
    results = []
    for round_ in range(args.rounds):
        for tp in (1, 2):
            llm = LLM(tensor_parallel_size=tp, threads=2, kv_cache_memory=1 << 30)
            run(llm, prompts[:1], None, 8)  # warm-up
            single = run(llm, prompts[:1], meter if tp > 1 else None, args.max_tokens)
            batch = run(llm, prompts, meter if tp > 1 else None, args.max_tokens)
            llm.engine.shutdown()
            row = {"round": round_, "tp": tp, "single": single, "batch": batch}
            print(json.dumps(row), flush=True)
            results.append(row)


if __name__ == "__main__":
    main()
