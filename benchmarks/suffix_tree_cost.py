"""What suffix decoding's trees cost per engine step, C++ (tachyllm's kernels) against the pure
Python trees they replaced, side by side in one process, no model involved.

    .venv/bin/python benchmarks/suffix_tree_cost.py [--python-from 824d2cc] [--batches 1,32] [--rounds 2]

--python-from names a commit whose tachyllm/spec_decode/suffix_tree.py still held the Python trees
(read with `git show`, so run it inside the repository). A step, per row of the batch: append the
tokens the last verification accepted (1 to 5, as a draft is partly accepted) to the row's own tree,
then propose: the best draft of the row's own tree and of the tree of finished outputs (vLLM's
default depth 24, up to 24 tokens). Every row's text is a 1,500-token prompt whose answer copies
spans of it with edits (an input-grounded answer); the tree of finished outputs holds 100 earlier
such answers. The rows, their texts and the accepted counts are the same for both implementations;
they take turns for --rounds rounds and the median per step is printed. The objects that exist before
the timed steps (the Python global tree) are frozen out of the garbage collector's passes.
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
from collections.abc import Callable
from typing import Any

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


def run_steps(module: Any, global_tree: Any, texts: list[tuple[list[int], list[int]]], accepts: list[int]) -> float:
    """Seconds per step over the answers of `texts` (one row each), decoded `accepts` at a time."""
    trees = []
    for prompt, _ in texts:
        tree = module.SuffixTree(DEPTH)
        tree.extend(prompt)
        trees.append(tree)
    whole = [prompt + answer for prompt, answer in texts]
    done = [0] * len(texts)
    steps, t0, turn = 0, time.perf_counter(), 0
    while min(done) < ANSWER_TOKENS - 5:
        for row, (tree, (prompt, answer)) in enumerate(zip(trees, texts)):
            step = accepts[turn % len(accepts)]
            turn += 1
            tree.extend(answer[done[row] : done[row] + step])
            done[row] += step
            end = len(prompt) + done[row]
            context = whole[row][end - DEPTH : end]
            if hasattr(tree, "speculate_own"):  # the C++ trees' path in the proposer: no lookups
                own = tree.speculate_own(MAX_TOKENS, FACTOR, MIN_PROB)
            else:
                own = tree.speculate(context, MAX_TOKENS, FACTOR, MIN_PROB)
            shared = global_tree.speculate(context, MAX_TOKENS, FACTOR, MIN_PROB)
            _ = own if own.score >= shared.score else shared
        steps += 1
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python-from", default="824d2cc", help="a commit with the pure Python trees")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    finished = [grounded_text(rng)[1] for _ in range(FINISHED)]
    accepts = [rng.randrange(1, 6) for _ in range(997)]
    old = python_trees(args.python_from)
    builders: dict[str, Callable[[], Any]] = {
        "python": lambda: old.GlobalSuffixTree(DEPTH, FINISHED),
        "c++": lambda: native_trees.GlobalSuffixTrees(DEPTH, FINISHED),
    }
    modules = {"python": old, "c++": native_trees}
    globals_ = {}
    for name, build in builders.items():
        t0 = time.perf_counter()
        globals_[name] = build()
        for seq_id, output in enumerate(finished):
            globals_[name].add(seq_id, output)
        print(f"{name}: {FINISHED} finished outputs put in the global tree in {time.perf_counter() - t0:.2f} s")
    # The Python trees are millions of objects: left to the collector, its full passes over them
    # would land in whichever run happens to allocate at the time, the C++ ones included.
    gc.collect()
    gc.freeze()
    print("| batch | python ms/step | c++ ms/step | python / c++ |")
    print("|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        texts = [grounded_text(random.Random(batch * 1000 + i)) for i in range(batch)]
        times: dict[str, list[float]] = {name: [] for name in modules}
        for _ in range(args.rounds):
            for name, module in modules.items():
                times[name].append(run_steps(module, globals_[name], texts, accepts))
        py, cc = statistics.median(times["python"]), statistics.median(times["c++"])
        print(f"| {batch} | {py * 1e3:.3f} | {cc * 1e3:.3f} | {py / cc:.1f}x |")


if __name__ == "__main__":
    main()
