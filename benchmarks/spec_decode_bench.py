"""Speculative decoding on the default model: tokens/s with and without speculation, acceptance
rate and mean acceptance length, per task, proposer and k; batch 1 and batch 32.

    .venv/bin/python benchmarks/spec_decode_bench.py [--threads 2] [--max-tokens 128] [--json out.json]
    .venv/bin/python benchmarks/spec_decode_bench.py --ngram-ceiling   # what n-gram lookup could give

Tasks: "grounded" asks to rewrite a code snippet with one change (the answer should quote its
input, where n-gram lookup shines; this model often rewrites more than asked); "proofread" asks to
return a short passage with its spelling mistake corrected (the answer is the input, nearly word
for word); "records" asks for the same JSON record of one person after another (the answers share
long spans with each other: suffix decoding's global tree of finished outputs warms up over the
run); "chat" asks open questions (nothing to look up; a draft model has to guess). Greedy,
ignore_eos off (answers end where the model ends them; tokens/s counts what was generated). Every
configuration is loaded in the same process and they take turns on each workload for --rounds
rounds (median reported), so ratios are comparable on a shared machine. The adaptive switch is on
(the default) everywhere. A suffix-decoding engine starts every measured run with an empty tree of
finished outputs, so that a round never drafts from the previous round's answers to the same prompts.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass

from tachyllm import LLM, SamplingParams
from tachyllm.spec_decode.ngram import NgramProposer
from tachyllm.spec_decode.suffix import SuffixProposer
from tachyllm.spec_decode.suffix_tree import GlobalSuffixTrees

SNIPPETS = [
    "def count_down(n):\n    result = []\n    i = n\n    while i > 0:\n        result.append(i)\n        i -= 1\n"
    "    return result\n",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    if len(values) == 0:\n"
    "        return 0\n    return total / len(values)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
    "        self.count += 1\n\n    def reset(self):\n        self.count = 0\n",
    "def read_lines(path):\n    lines = []\n    with open(path) as f:\n        for line in f:\n"
    "            lines.append(line.strip())\n    return lines\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, n):\n        if n % d == 0:\n"
    "            return False\n    return True\n",
    "def merge(a, b):\n    out = dict(a)\n    for key, value in b.items():\n        out[key] = value\n    return out\n",
    "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
    "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
    "        else:\n            print(i)\n",
    "def flatten(nested):\n    flat = []\n    for item in nested:\n        if isinstance(item, list):\n"
    "            flat.extend(flatten(item))\n        else:\n            flat.append(item)\n    return flat\n",
]
CHANGES = [
    "Rename the function to a better name and change nothing else",
    "Add a docstring and change nothing else",
    "Add type hints and change nothing else",
    "Rewrite it with one small improvement, keeping the rest identical",
]
TOPICS = [
    "how vaccines train the immune system", "why the sky is blue", "tips for learning to cook",
    "the history of the printing press", "how to start running as a beginner", "what a black hole is",
    "how bees make honey", "the water cycle", "how to write a good cover letter", "why sleep matters",
    "how a bicycle stays upright", "the causes of the seasons", "how to care for a houseplant",
    "what inflation is", "how computers store numbers", "the life of a star", "how to make friends in a new city",
    "why leaves change colour in autumn", "how rainbows form", "how to plan a small garden",
    "what photosynthesis does", "how to save money on groceries", "how tides work", "the rules of chess",
    "how to stay focused while studying", "how volcanoes erupt", "what a healthy breakfast looks like",
    "how the internet routes messages", "why cats purr", "how to learn a new language", "how glass is made",
    "the benefits of walking",
]  # fmt: skip


PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to five "
    "books at a time, and the loan period is three weeks. Late returns are charged a small fee per day.",
    "Our team meets every Monday to plan the week. Each member shares what they finished, what they are working "
    "on, and anything that is blocking them. The meeting should never last more then thirty minutes.",
    "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes "
    "until it is smooth, then let it rise for an hour in a warm place before baking.",
    "The train to the coast leaves from platform four at half past eight. Passengers should arrive ten minutes "
    "early, keep their tickets ready, and store large bags in the racks at the end of each carriage.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, so "
    "water boils at a lower temperture, which is why cooking takes longer in the mountains.",
    "Please remember to turn off the lights when you leave the office. The last person to leave should also check "
    "that the windows are closed and that the alarm is set before locking the front door.",
    "The park has a small lake where children can feed the ducks. There is a cafe near the entrance that sells "
    "sandwiches and hot drinks, and public toilets are located behind the playground.",
    "Our new phone has a larger screen, a faster processor and a battery that lasts two full days. It comes in "
    "three colours and will be available in stores from the first of next month.",
]
PROOFREADING = [
    "Copy the following text exactly, correcting any spelling mistake",
    "Rewrite the following text with correct spelling, changing nothing else",
    "Fix the typo in the following text and give the whole corrected text",
    "Proofread the following text and return it in full with any mistake corrected",
]  # fmt: skip


def proofread_prompts() -> list[list[dict]]:
    """Each passage under each instruction; consecutive prompts differ in both (batch 1 takes the
    first few)."""
    return [
        [{"role": "user", "content": f"{PROOFREADING[(i + j) % 4]}:\n\n{PASSAGES[i]}"}]
        for j in range(4) for i in range(len(PASSAGES))
    ]  # fmt: skip


def grounded_prompts() -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"{change}:\n\n```python\n{snippet}```"}]
        for change in CHANGES for snippet in SNIPPETS
    ]  # fmt: skip


PEOPLE = [
    ("Maria Lopez", "Valencia", 34, "nurse"), ("Tom Becker", "Hamburg", 51, "bus driver"),
    ("Aiko Tanaka", "Osaka", 28, "architect"), ("Samuel Okafor", "Lagos", 42, "teacher"),
    ("Lena Novak", "Prague", 23, "student"), ("Raj Patel", "Leicester", 39, "pharmacist"),
    ("Chloe Martin", "Lyon", 31, "baker"), ("Ivan Petrov", "Sofia", 60, "engineer"),
    ("Grace Kim", "Busan", 45, "lawyer"), ("Lucas Silva", "Porto", 27, "chef"),
    ("Emma Johansson", "Uppsala", 36, "doctor"), ("Omar Haddad", "Amman", 48, "accountant"),
    ("Nina Rossi", "Turin", 29, "designer"), ("Peter Walsh", "Cork", 55, "farmer"),
    ("Sara Cohen", "Haifa", 33, "journalist"), ("Ahmed Ali", "Cairo", 40, "pilot"),
]  # fmt: skip


def records_prompts() -> list[list[dict]]:
    """The same extraction task over one person after another (an agent's tool loop, a batch job)."""
    return [
        [{"role": "user", "content": (
            "Return a JSON object with the keys \"name\", \"city\", \"age\", \"job\" and \"summary\" "
            f"for this person, and nothing else: {name} is {age} years old, lives in {city} and works as a {job}."
        )}]
        for name, city, age, job in PEOPLE
    ]  # fmt: skip


def chat_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Explain {topic} in a few paragraphs."}] for topic in TOPICS]


CONFIGS = {
    "none": None,
    "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2},
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8},
    "suffix": {"method": "suffix"},  # vLLM's defaults: up to 24 tokens, as the match allows
    "self:int4 k=2": {"method": "draft_model", "model": "self:int4", "num_speculative_tokens": 2},
    "self:int4 k=4": {"method": "draft_model", "model": "self:int4", "num_speculative_tokens": 4},
    # Speculation forced on (no adaptive switch): what a draft would give if always used.
    "self:int4 k=4 forced": {
        "method": "draft_model",
        "model": "self:int4",
        "num_speculative_tokens": 4,
        "adaptive": False,
    },
    "self:layers=16 k=3 forced": {
        "method": "draft_model",
        "model": "self:layers=16",
        "num_speculative_tokens": 3,
        "adaptive": False,
    },
}


@dataclass
class Row:
    config: str
    task: str
    batch: int
    tokens: int
    seconds: float
    tok_per_s: float
    speedup: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None


def run(llm: LLM, prompts: list[list[dict]], batch: int, max_tokens: int) -> tuple[int, float, int, int, int]:
    """Generates for every prompt, `batch` at a time; returns tokens, seconds and spec counters."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    proposer = llm.engine.speculator.proposer if llm.engine.speculator else None
    if isinstance(proposer, SuffixProposer):  # a cold start: nothing drafted from earlier rounds
        proposer.global_trees = GlobalSuffixTrees(proposer.max_depth, proposer.global_trees.max_sequences)
    stats = llm.engine.stats
    before = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.chat(prompts[i : i + batch], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    seconds = time.perf_counter() - t0
    after = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    return tokens, seconds, drafts, draft_tokens, accepted


@dataclass
class _Context:
    """What NgramProposer.propose reads of a Sequence."""

    token_ids: list[int]


def ngram_ceiling(threads: int | None, max_tokens: int) -> None:
    """How far n-gram lookup could go on these tasks with this model, free of timing noise: each
    prompt's greedy answer is generated once without speculation, then the proposer is replayed
    on every prefix of it (greedy verification accepts a draft's longest prefix that matches what
    the model says next). Tokens per target forward is the speedup a verification step costing
    exactly one plain decode step would give, before the prefill is counted."""
    llm = LLM(threads=threads)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    print("| task | prompts | mean answer tokens | lookup (min, max) | k | tokens per target forward |")
    print("|---|---|---|---|---|---|")
    for task, prompts in {
        "grounded": grounded_prompts(),
        "proofread": proofread_prompts(),
        "chat": chat_prompts(),
    }.items():
        outs = llm.chat(prompts, params, use_tqdm=False)
        answers = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
        mean_len = sum(len(a) for _, a in answers) / len(answers)
        for lookup, k in [((2, 4), 4), ((2, 4), 8), ((1, 4), 8), ((2, 8), 8)]:
            proposer = NgramProposer(*lookup)
            forwards = tokens = 0
            for prompt, answer in answers:
                done = 1  # the prefill produced the first token
                while done < len(answer):
                    drafts = proposer.propose(_Context(list(prompt) + list(answer[:done])), k)
                    accepted = next(
                        (i for i, d in enumerate(drafts) if done + i >= len(answer) or d != answer[done + i]),
                        len(drafts),
                    )
                    done += accepted + 1
                    forwards += 1
                    tokens += accepted + 1
            print(f"| {task} | {len(answers)} | {mean_len:.1f} | {lookup} | {k} | {tokens / forwards:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts per task at batch 1")
    ap.add_argument("--tasks", default="grounded,proofread,records,chat", help="comma list of tasks to run")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the median is reported")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--batches", default="1,32", help="comma list of batch sizes to run (1 and/or 32)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ngram-ceiling", action="store_true", help="only replay n-gram lookup on plain greedy answers")
    args = ap.parse_args()
    if args.ngram_ceiling:
        return ngram_ceiling(args.threads, args.max_tokens)
    batches = [int(b) for b in args.batches.split(",")]
    logging.basicConfig(level=logging.WARNING)
    every_task = {
        "grounded": grounded_prompts(),
        "proofread": proofread_prompts(),
        "records": records_prompts(),
        "chat": chat_prompts(),
    }
    tasks = {task: every_task[task] for task in args.tasks.split(",")}
    names = args.configs.split(",")
    # Every engine is loaded first and the configurations take turns on each workload, round after
    # round, so that drift in the machine's speed hits them all alike.
    engines = {name: LLM(threads=args.threads, speculative_config=CONFIGS[name]) for name in names}
    for llm in engines.values():
        llm.chat(every_task["chat"][0], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    samples: dict[tuple[str, str, int], list[tuple[int, float, int, int, int]]] = {}
    for _ in range(args.rounds):
        for task, prompts in tasks.items():
            # records: all of them at batch 1 too, since the point is how the later ones gain
            first = len(prompts) if task == "records" else args.batch1_prompts
            for batch, subset in ((1, prompts[:first]), (32, prompts[:32])):
                if batch not in batches:
                    continue
                for name, llm in engines.items():
                    samples.setdefault((name, task, batch), []).append(run(llm, subset, batch, args.max_tokens))
    rows: list[Row] = []
    baseline: dict[tuple[str, int], float] = {}
    for (name, task, batch), runs in samples.items():
        runs.sort(key=lambda r: r[0] / r[1])
        tokens, seconds, drafts, draft_tokens, accepted = runs[len(runs) // 2]  # median rate
        rate = tokens / seconds
        if CONFIGS[name] is None:
            baseline[(task, batch)] = rate
        rows.append(Row(
            name, task, batch, tokens, round(seconds, 2), round(rate, 1), 0.0,
            round(accepted / draft_tokens, 3) if draft_tokens else None,
            round(1 + accepted / drafts, 2) if drafts else None,
        ))  # fmt: skip
    for r in rows:
        base = baseline.get((r.task, r.batch))
        r.speedup = round(r.tok_per_s / base, 2) if base else float("nan")
    print("| config | task | batch | tok/s | speedup | acceptance rate | mean acceptance length |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.config} | {r.task} | {r.batch} | {r.tok_per_s} | {r.speedup}x | "
            f"{r.acceptance_rate} | {r.mean_acceptance_length} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
