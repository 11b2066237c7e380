"""What tensor parallelism costs where it cannot help: the default model (SmolLM2-135M,
bf16) at TP=1 with 2 threads against TP=2 with 1 thread each, on one 2-core host, its sums over
each of the --tp-all-reduce ways (shared memory, gloo).

For each configuration (alternated over --rounds, the machine being shared):
  - single stream: 128-token prompt, 128 new tokens, output tokens/s;
  - offline batch: 64 prompts x 128 tokens, 128 new tokens each, output tokens/s (prefill included);
  - at TP=2, rank 0's time inside the collectives per step (the all-reduces of the embedding and of
    every layer's attention and MLP outputs, and the LM head's logit gather; waiting for the other
    rank included) and the bytes each step hands to them, per token.
Greedy, EOS ignored. `--allreduce` instead times the all-reduce alone between 2 processes (1 thread
each), gloo's and the shared-memory one alternately, at the sizes a step of this model hands it: one
decode token (576 bf16 values), 64 of them, and a full 2048-token step.

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
from tachyllm.distributed import shm_allreduce
from tachyllm.distributed.group import TPGroup
from tachyllm.option_values import TP_ALL_REDUCES

ALLREDUCE_SIZES = [576, 64 * 576, 2048 * 576]  # bf16 values: a decode token, 64 of them, a full step


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


def _allreduce_rank(rank: int, store: str, shm_path: str, repeats: int, rounds: int) -> None:
    torch.set_num_threads(1)
    group = TPGroup.join(store, rank, 2, torch.device("cpu"), shm_path)
    ways = {"gloo": lambda x: group.pg.allreduce([x]).wait(), "shm": group.shm.all_reduce}
    for round_ in range(rounds):
        for numel in ALLREDUCE_SIZES:
            x = torch.ones(numel, dtype=torch.bfloat16)
            for way, reduce in ways.items():
                for _ in range(50):
                    reduce(x.fill_(1))
                t0 = time.perf_counter()
                for _ in range(repeats):
                    reduce(x)
                us = 1e6 * (time.perf_counter() - t0) / repeats
                if rank == 0:
                    row = {"round": round_, "all_reduce": way, "bytes": 2 * numel, "us_per_call": round(us, 1)}
                    print(json.dumps(row), flush=True)


def allreduce(repeats: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        shm_path = os.path.join(shm_allreduce.SHM_DIR, os.path.basename(directory))
        shm_allreduce.create(shm_path, 2, 2 * max(ALLREDUCE_SIZES))
        try:
            mp.spawn(_allreduce_rank, args=(store, shm_path, repeats, rounds), nprocs=2)
        finally:
            shm_allreduce.remove(shm_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (prompts: 128 tokens)")
    parser.add_argument(
        "--tp-all-reduce", nargs="+", choices=TP_ALL_REDUCES, default=list(TP_ALL_REDUCES),
        help="the TP=2 configurations: their sums over shared memory, gloo, or both (default: both)",
    )  # fmt: skip
    parser.add_argument("--allreduce", action="store_true", help="time gloo's and the shm all-reduce alone")
    parser.add_argument("--repeats", type=int, default=2000, help="--allreduce: calls timed per size and way")
    args = parser.parse_args()
    if args.allreduce:
        allreduce(args.repeats, args.rounds)
        return
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(args.batch)]
    meter = CollectiveMeter()
    results = []
    configurations = [(1, None)] + [(2, way) for way in args.tp_all_reduce]
    for round_ in range(args.rounds):
        for tp, way in configurations:
            llm = LLM(tensor_parallel_size=tp, threads=2, kv_cache_memory=1 << 30, tp_all_reduce=way)
            run(llm, prompts[:1], None, 8)  # warm-up
            single = run(llm, prompts[:1], meter if tp > 1 else None, args.max_tokens)
            batch = run(llm, prompts, meter if tp > 1 else None, args.max_tokens)
            llm.engine.shutdown()
            row = {"round": round_, "tp": tp, "all_reduce": way, "single": single, "batch": batch}
            print(json.dumps(row), flush=True)
            results.append(row)


if __name__ == "__main__":
    main()
