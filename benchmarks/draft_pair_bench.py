"""A real draft/target pair: Qwen2.5-Coder-0.5B-Instruct drafting for
Qwen2.5-Coder-1.5B-Instruct, both Q4_K_M GGUF (assembled from PyPI by qwen_coder_models.py).

    .venv/bin/python benchmarks/draft_pair_bench.py [--threads 2] [--configs none,draft-k4,...]
        [--batches 1,8,32] [--rounds 2] [--max-tokens 128] [--fp32-check 2] [--json out.json]

Tasks: "code" (write a function from its docstring; refactor given code) and "chat" (open
questions). Greedy with the chat template; answers end where the model ends them. Every
configuration is loaded in the same process and they take turns on each workload for --rounds
rounds (median reported), so ratios are comparable on a shared machine. Reported per
configuration, task and batch: output tok/s and the speedup over the target alone, vLLM's
acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted / drafts), the
acceptance per draft position (accepted at position i / drafts), and whether every answer equals
the target alone's token for token (bf16 with --deterministic, the default: batch-invariant kernels
make a verification forward round like a one-token one). --fp32-check N also compares a few
short answers in float32, with and without the draft. One engine holds the target, and each
configuration's speculator is attached to it in turn ("none": detached). A last table gives the
median wall time of the engine's steps, the target's forwards by tokens per step (a verification
of k drafts: k + 1 at batch 1) and the draft's proposals, per configuration and batch size.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qwen_coder_models import DEFAULT_CACHE, qwen_coder_pair

from tachyllm import LLM, SamplingParams
from tachyllm.loading import load_checkpoint
from tachyllm.quantization.activation_bits import model_activation_bits
from tachyllm.spec_decode.speculator import Speculator
from tachyllm.speculative_config import SpeculativeConfig

DOCSTRINGS = [
    "Write the body of this Python function:\n\n```python\ndef is_palindrome(text: str) -> bool:\n"
    '    """True when text reads the same backwards, ignoring case, spaces and punctuation."""\n```',
    "Write the body of this Python function:\n\n```python\ndef merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list in linear time."""\n```',
    "Write the body of this Python function:\n\n```python\ndef word_counts(path: str) -> dict[str, int]:\n"
    '    """Count how often each lower-cased word occurs in the text file at path."""\n```',
]
REFACTORS = [
    "Refactor this code to use a list comprehension and type hints, and keep its behaviour:\n\n```python\n"
    "def squares_of_evens(values):\n    result = []\n    for v in values:\n        if v % 2 == 0:\n"
    "            result.append(v * v)\n    return result\n```",
    "Refactor this class into a dataclass with the same fields and methods:\n\n```python\nclass Point:\n"
    "    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n\n    def __repr__(self):\n"
    "        return f'Point({self.x}, {self.y})'\n```",
    "Refactor this function to remove the duplicated code:\n\n```python\ndef describe(user):\n"
    "    if user.is_admin:\n        print('Name: ' + user.name)\n        print('Email: ' + user.email)\n"
    "        print('Role: admin')\n    else:\n        print('Name: ' + user.name)\n"
    "        print('Email: ' + user.email)\n        print('Role: user')\n```",
]
# Alternating, so that the first N prompts hold both kinds.
CODE = [prompt for pair in zip(DOCSTRINGS, REFACTORS) for prompt in pair]
CHAT = [
    "Explain why the sky is blue in a few sentences.",
    "Give me three tips for learning to cook.",
    "What is the difference between a process and a thread?",
    "How do bees make honey?",
    "Suggest a name for a bakery and say why.",
    "Why does the moon have phases?",
]


def draft_config(draft: Path, k: int, **extra) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, **extra}


def configs(draft: Path) -> dict[str, dict | None]:
    """The speculative_config of each named configuration (None: the target alone)."""
    return {
        "none": None,
        "draft-k4": draft_config(draft, 4),
        "draft-k6": draft_config(draft, 6),
        "draft-int4-k4": draft_config(draft, 4, quantization="int4"),
        "draft-int4-k6": draft_config(draft, 6, quantization="int4"),
        "draft-k4-forced": draft_config(draft, 4, adaptive=False),
        "draft-int4-k4-forced": draft_config(draft, 4, quantization="int4", adaptive=False),
        # The draft's LM head over a shortlist of the vocabulary (draft_vocab_size).
        "draft-int4-k4-v32k": draft_config(draft, 4, quantization="int4", draft_vocab_size=32768),
        "draft-int4-k4-v64k": draft_config(draft, 4, quantization="int4", draft_vocab_size=65536),
        "draft-int4-k4-v32k-forced": draft_config(
            draft, 4, quantization="int4", draft_vocab_size=32768, adaptive=False
        ),
        "draft-int4-k4-v64k-forced": draft_config(
            draft, 4, quantization="int4", draft_vocab_size=65536, adaptive=False
        ),
    }


@dataclass
class Sample:
    tokens: int
    seconds: float
    drafts: int
    draft_tokens: int
    accepted: int
    per_pos: list[int]
    answers: list[list[int]]


@dataclass
class Row:
    config: str
    task: str
    batch: int
    runs: int
    tok_per_s: float
    tok_per_s_runs: list[float]
    speedup: float | None = None  # median over rounds of the round's ratio to the target alone
    speedup_runs: list[float] = field(default_factory=list)
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    acceptance_per_position: list[float] = field(default_factory=list)
    identical_to_target: bool | None = None


def run(llm: LLM, prompts: list[str], batch: int, max_tokens: int) -> Sample:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    stats = llm.engine.stats
    before = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    pos_before = list(stats.spec_accepted_per_pos)
    answers, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        chats = [[{"role": "user", "content": p}] for p in prompts[i : i + batch]]
        answers += [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
    seconds = time.perf_counter() - t0
    after = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    pos_before += [0] * (len(stats.spec_accepted_per_pos) - len(pos_before))
    per_pos = [a - b for a, b in zip(stats.spec_accepted_per_pos, pos_before)]
    return Sample(sum(map(len, answers)), seconds, drafts, draft_tokens, accepted, per_pos, answers)


def summarise(name: str, task: str, batch: int, k: int, samples: list[Sample], reference: list[Sample] | None) -> Row:
    rates = [s.tokens / s.seconds for s in samples]
    drafts = sum(s.drafts for s in samples)
    draft_tokens = sum(s.draft_tokens for s in samples)
    accepted = sum(s.accepted for s in samples)
    # The engine's per-position counters are shared by the speculators attached to it: k positions are this one's.
    per_pos = [sum(s.per_pos[i] for s in samples if i < len(s.per_pos)) for i in range(k)]
    row = Row(name, task, batch, len(samples), round(statistics.median(rates), 2), [round(r, 2) for r in rates])
    if draft_tokens:
        row.acceptance_rate = round(accepted / draft_tokens, 3)
        row.mean_acceptance_length = round(1 + accepted / drafts, 2)
        row.acceptance_per_position = [round(a / drafts, 3) for a in per_pos]
    if reference is not None:
        row.identical_to_target = all(s.answers == reference[0].answers for s in samples)
        # Each round's ratio to the target alone in the same round: the machine's speed drifts
        # between rounds far more than within one.
        ratios = [(s.tokens / s.seconds) / (r.tokens / r.seconds) for s, r in zip(samples, reference)]
        row.speedup, row.speedup_runs = round(statistics.median(ratios), 2), [round(x, 2) for x in ratios]
    return row


def fp32_check(target: Path, draft: Path, prompts: list[str], max_tokens: int, threads: int | None) -> bool:
    """Greedy answers in float32 with and without the draft (both files dequantized, no rounding
    of activations anywhere): token for token the same? One float32 target (6 GiB) and its draft
    (2 GiB): about 10 GiB at the peak of loading."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm = LLM(str(target), dtype="float32", threads=threads, max_model_len=1024, kv_cache_memory=256 << 20)
    plain = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
    attach(llm, target, draft_config(draft, 4, adaptive=False))
    spec = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
    stats = llm.engine.stats
    same = plain == spec
    print(
        f"fp32 check: {len(prompts)} prompts x {max_tokens} tokens, identical with the draft: {same} "
        f"({stats.spec_num_accepted_tokens}/{stats.spec_num_draft_tokens} draft tokens accepted)", flush=True,
    )  # fmt: skip
    return same


class StepTimes:
    """Wall time of the engine's steps, of its target forwards (by tokens in the step) and of the draft's
    proposals, per configuration and batch size: where a speculative step's time goes."""

    def __init__(self, llm: LLM):
        self.current = ""
        self.times: dict[tuple[str, str], list[float]] = {}
        self._time(llm.engine, "_step", lambda: "engine step")
        self._time(llm.engine.runner, "execute", lambda batch: f"target forward, {batch.num_tokens} tokens")

    def watch(self, speculator: Speculator | None) -> None:
        if speculator is not None:
            self._time(speculator, "propose", lambda scheduler: "draft proposals")

    def _time(self, owner: object, method: str, what) -> None:
        real = getattr(owner, method)

        def timed(*args):
            t0 = time.perf_counter()
            out = real(*args)
            self.times.setdefault((self.current, what(*args)), []).append(time.perf_counter() - t0)
            return out

        setattr(owner, method, timed)

    def print_table(self, min_count: int = 10) -> None:
        print("\n| config, batch | what | count | median ms |\n|---|---|---|---|")
        for (config, what), seconds in sorted(self.times.items()):
            if len(seconds) >= min_count:
                print(f"| {config} | {what} | {len(seconds)} | {statistics.median(seconds) * 1e3:.1f} |")


def attach(llm: LLM, target: Path, spec: dict | None) -> Speculator | None:
    """A speculator for llm's engine with this speculative_config, built as the engine builds its own."""
    if spec is None:
        return None
    engine = llm.engine
    config = dataclasses.replace(engine.config, speculative_config=SpeculativeConfig.from_dict(spec))
    speculator = Speculator(
        config, target=engine.model, ckpt=load_checkpoint(str(target)), sampler=engine.runner.sampler,
        num_blocks=engine.block_manager.num_blocks, block_size=config.block_size,
        max_model_len=engine.max_model_len, dtype=engine.dtype, backend=engine.backend,
        step_costs=engine.scheduler.step_cost,
    )  # fmt: skip
    engine.speculator = speculator
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return speculator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=6, help="prompts per task at batch 1")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the median is reported")
    ap.add_argument("--configs", default="none,draft-k4,draft-int4-k4", help="comma list (see configs())")
    ap.add_argument("--batches", default="1", help="comma list of batch sizes (8 and 32 take the first N prompts)")
    ap.add_argument("--tasks", default="code,chat")
    ap.add_argument("--fp32-check", type=int, default=0, help="prompts for the float32 identity check (0: none)")
    ap.add_argument("--fp32-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--quant-activation-bits", type=int, default=None, choices=[8, 16],
        help="the target's and drafts' (default: unset, the engine's rule: the target checks 8 bits, drafts 16)",
    )  # fmt: skip
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    draft, target = qwen_coder_pair(args.cache_dir)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    if args.fp32_check:
        fp32_check(target, draft, CODE[: args.fp32_check], args.fp32_tokens, args.threads)
        gc.collect()
    all_tasks = {"code": CODE, "chat": CHAT}
    tasks = {t: all_tasks[t] for t in args.tasks.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    # One engine holds the target; each configuration is a speculator attached to it in turn (the
    # target's 3 GiB of dequantized weights once, not once per configuration, on a shared machine).
    t0 = time.perf_counter()
    llm = LLM(
        str(target), quantization="gguf", quant_activation_bits=args.quant_activation_bits, threads=args.threads,
        max_model_len=2048, kv_cache_memory=512 << 20,
    )  # fmt: skip
    bits = model_activation_bits(llm.engine.model)
    print(f"loaded the target in {time.perf_counter() - t0:.0f} s, activations rounded to {bits} bits", flush=True)
    specs = configs(draft)
    speculators = {name: attach(llm, target, specs[name]) for name in args.configs.split(",")}
    step_times = StepTimes(llm)
    for speculator in speculators.values():
        step_times.watch(speculator)
    samples: dict[tuple[str, str, int], list[Sample]] = {}
    for round_ in range(args.rounds):
        for task, prompts in tasks.items():
            for batch in batches:
                # Batch 1 runs --prompts prompts one by one; larger batches repeat the task's prompts to fill one batch.
                subset = prompts[: args.prompts] if batch == 1 else (prompts * batch)[:batch]
                for name, speculator in speculators.items():
                    llm.engine.speculator = speculator
                    step_times.current = f"{name}, {batch}"
                    s = run(llm, subset, batch, args.max_tokens)
                    samples.setdefault((name, task, batch), []).append(s)
                    print(
                        f"round {round_} {task} batch {batch} {name}: {s.tokens} tokens "
                        f"{s.tokens / s.seconds:.2f} tok/s accepted {s.accepted}/{s.draft_tokens}", flush=True,
                    )  # fmt: skip
    print(f"load average at the end: {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for (name, task, batch), runs in samples.items():
        reference = samples.get(("none", task, batch)) if name != "none" else None
        k = specs[name]["num_speculative_tokens"] if specs[name] else 0
        rows.append(summarise(name, task, batch, k, runs, reference))
    print("| config | task | batch | tok/s (median; runs) | vs target alone (median; rounds) | acceptance rate"
          " | mean acceptance length"
          " | acceptance per position | identical to target alone |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_pos = " / ".join(f"{a:.2f}" for a in r.acceptance_per_position) or "-"
        print(
            f"| {r.config} | {r.task} | {r.batch} | {r.tok_per_s} ({', '.join(map(str, r.tok_per_s_runs))}) "
            f"| {r.speedup or 1.0}x ({', '.join(map(str, r.speedup_runs)) or '-'}) | {r.acceptance_rate or '-'} "
            f"| {r.mean_acceptance_length or '-'} | {per_pos} "
            f"| {'-' if r.identical_to_target is None else r.identical_to_target} |"
        )
    step_times.print_table()
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
