"""What suffix decoding's trees cost per engine step, C++ (tachyllm's kernels) against the pure
Python trees they replaced and, optionally, arctic-inference's suffix trees, side by side in one
process, no model involved.

    .venv/bin/python benchmarks/suffix_tree_cost.py [--python-from 824d2cc] [--arctic-path DIR]
        [--batches 1,32] [--rounds 2]

--python-from names a commit whose tachyllm/spec_decode/suffix_tree.py still held the Python trees
(read with `git show`, so run it inside the repository). --arctic-path is a folder holding an installed
`arctic_inference` (Snowflake's package, vLLM's "suffix" method; e.g. `pip install --no-deps --target
DIR` of a wheel built from its source package): its `SuffixDecodingCache` then runs the same steps.
A step, per row of the batch: append the tokens the last verification accepted (1 to 5, as a draft is
partly accepted) to the row's own tree, then propose: the best draft of the row's own tree and of the
tree of finished outputs (vLLM's default depth 24, up to 24 tokens). tachyllm's C++ trees do this for
every row in one call (`propose_drafts`, the proposer's path); the others take a call per row. Every
row's text is a 1,500-token prompt whose answer copies spans of it with edits (an input-grounded
answer); the tree of finished outputs holds 100 earlier such answers. The rows, their texts and the
accepted counts are the same for every implementation; they take turns for --rounds rounds and the
median per step is printed. The objects that exist before the timed steps (the Python global tree)
are frozen out of the garbage collector's passes.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import subprocess
import sys
import time
import types
from typing import Any, Protocol

from tachyllm.spec_decode import suffix_tree as native_trees

DEPTH, MAX_TOKENS, FACTOR, MIN_PROB = 24, 24, 1.0, 0.1
VOCAB, PROMPT_TOKENS, ANSWER_TOKENS, FINISHED = 32_000, 1_500, 400, 100


def python_trees(commit: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "show", f"{commit}:tachyllm/spec_decode/suffix_tree.py"], check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType("python_suffix_tree")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{commit}:suffix_tree.py", "exec"), module.__dict__)
    return module


def grounded_text(rng: random.Random) -> tuple[list[int], list[int]]:
    """A prompt of random tokens and an answer made of spans copied from it, each followed by an edit."""
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    answer: list[int] = []
    while len(answer) < ANSWER_TOKENS:
        start = rng.randrange(PROMPT_TOKENS - 40)
        answer += prompt[start : start + rng.randrange(8, 40)] + [rng.randrange(VOCAB)]
    return prompt, answer[:ANSWER_TOKENS]


class Trees(Protocol):
    """One implementation: the tree of finished outputs built once, then rows started and stepped."""

    def finish(self, seq_id: int, output: list[int]) -> None: ...

    def start(self, prompts: list[list[int]]) -> None: ...

    def step(self, accepted: list[list[int]], contexts: list[list[int]]) -> None: ...


class PythonTrees:
    def __init__(self, module: Any):
        self.module, self.shared = module, module.GlobalSuffixTree(DEPTH, FINISHED)
        self.own: list[Any] = []

    def finish(self, seq_id: int, output: list[int]) -> None:
        self.shared.add(seq_id, output)

    def start(self, prompts: list[list[int]]) -> None:
        self.own = []
        for prompt in prompts:
            tree = self.module.SuffixTree(DEPTH)
            tree.extend(prompt)
            self.own.append(tree)

    def step(self, accepted: list[list[int]], contexts: list[list[int]]) -> None:
        for tree, tokens, context in zip(self.own, accepted, contexts):
            tree.extend(tokens)
            own = tree.speculate(context, MAX_TOKENS, FACTOR, MIN_PROB)
            shared = self.shared.speculate(context, MAX_TOKENS, FACTOR, MIN_PROB)
            _ = own if own.score >= shared.score else shared


class NativeTrees:
    def __init__(self) -> None:
        self.shared = native_trees.GlobalSuffixTrees(DEPTH, FINISHED)
        self.own: list[native_trees.SuffixTree] = []
        self._shared_per_row: list[native_trees.SuffixTree | None] = []

    def finish(self, seq_id: int, output: list[int]) -> None:
        self.shared.add(seq_id, output)

    def start(self, prompts: list[list[int]]) -> None:
        self.own = [native_trees.SuffixTree(DEPTH) for _ in prompts]
        self._shared_per_row = [self.shared.trees[None]] * len(prompts)
        self._propose(prompts)

    def step(self, accepted: list[list[int]], contexts: list[list[int]]) -> None:
        self._propose(accepted)

    def _propose(self, new_tokens: list[list[int]]) -> None:
        native_trees.propose_drafts(
            self.own, new_tokens, self._shared_per_row, [MAX_TOKENS] * len(self.own), FACTOR, MIN_PROB
        )


class ArcticTrees:
    def __init__(self, cache_class: Any):
        # No bound: the rows of a run are evicted by hand, so the finished outputs stay the same 100.
        self.cache, self.rows = cache_class(max_tree_depth=DEPTH, max_cached_requests=-1), 0

    def finish(self, seq_id: int, output: list[int]) -> None:
        self.cache.start_request(("finished", seq_id), [])
        self.cache.add_active_response(("finished", seq_id), output)
        self.cache.stop_request(("finished", seq_id))

    def start(self, prompts: list[list[int]]) -> None:
        for row in range(self.rows):
            self.cache.stop_request(("row", row))
            self.cache.evict_cached_response(("row", row))
        for row, prompt in enumerate(prompts):
            self.cache.start_request(("row", row), prompt)
        self.rows = len(prompts)

    def step(self, accepted: list[list[int]], contexts: list[list[int]]) -> None:
        for row, (tokens, context) in enumerate(zip(accepted, contexts)):
            self.cache.add_active_response(("row", row), tokens)
            self.cache.speculate(
                ("row", row), context, max_spec_tokens=MAX_TOKENS, max_spec_factor=FACTOR, min_token_prob=MIN_PROB
            )


def run_steps(trees: Trees, texts: list[tuple[list[int], list[int]]], accepts: list[int]) -> float:
    """Seconds per step over the answers of `texts` (one row each), decoded `accepts` at a time."""
    trees.start([prompt for prompt, _ in texts])
    whole = [prompt + answer for prompt, answer in texts]
    done = [0] * len(texts)
    steps, t0, turn = 0, time.perf_counter(), 0
    while min(done) < ANSWER_TOKENS - 5:
        accepted, contexts = [], []
        for row, (prompt, answer) in enumerate(texts):
            step = accepts[turn % len(accepts)]
            turn += 1
            accepted.append(answer[done[row] : done[row] + step])
            done[row] += step
            end = len(prompt) + done[row]
            contexts.append(whole[row][end - DEPTH : end])
        trees.step(accepted, contexts)
        steps += 1
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python-from", default="824d2cc", help="a commit with the pure Python trees")
    ap.add_argument("--arctic-path", default=None, help="a folder with arctic_inference installed")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    finished = [grounded_text(rng)[1] for _ in range(FINISHED)]
    accepts = [rng.randrange(1, 6) for _ in range(997)]
    implementations: dict[str, Trees] = {"python": PythonTrees(python_trees(args.python_from)), "c++": NativeTrees()}
    if args.arctic_path:
        sys.path.insert(0, args.arctic_path)
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        implementations["arctic"] = ArcticTrees(SuffixDecodingCache)
    for name, trees in implementations.items():
        t0 = time.perf_counter()
        for seq_id, output in enumerate(finished):
            trees.finish(seq_id, output)
        print(f"{name}: {FINISHED} finished outputs put in its tree in {time.perf_counter() - t0:.2f} s")
    # The Python trees are millions of objects: left to the collector, its full passes over them
    # would land in whichever run happens to allocate at the time, the C++ ones included.
    gc.collect()
    gc.freeze()
    names = list(implementations)
    print(
        "| batch | "
        + " | ".join(f"{name} ms/step" for name in names)
        + " | "
        + " | ".join(f"{n} / c++" for n in names if n != "c++")
        + " |"
    )
    print("|---" * (2 * len(names)) + "|")
    for batch in [int(b) for b in args.batches.split(",")]:
        texts = [grounded_text(random.Random(batch * 1000 + i)) for i in range(batch)]
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                times[name].append(run_steps(implementations[name], texts, accepts))
        median = {name: statistics.median(times[name]) for name in names}
        cells = [f"{median[name] * 1e3:.3f}" for name in names]
        cells += [f"{median[name] / median['c++']:.1f}x" for name in names if name != "c++"]
        print(f"| {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
