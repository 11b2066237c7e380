"""lm-eval-harness (`lm-eval`, the `bench` extra) against `tachy serve`, on two small tasks
built from the repository's own held-out text (tachyllm/data/heldout.txt); nothing is downloaded.

  tachy_heldout_mc         loglikelihood (multiple_choice): a sentence's opening and four endings, its
                           own and three other sentences'; acc / acc_norm = the true ending scores best.
  tachy_heldout_next_word  generate_until: a sentence's opening; exact_match of the first word the model
                           writes against the sentence's next word.

lm-eval's `local-completions` scores a loglikelihood request as one /v1/completions call over token ids
with echo, logprobs 1 and max_tokens 1, and reads the prompt's token logprobs: the server's prompt
logprobs. Its tokenizer is the server's own (`tokenizer_backend=remote`: /tokenizer_info, /tokenize),
so no tokenizer is fetched from a hub; HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set all the same, and
the tasks read local jsonl files.

lm-eval pins its own dependencies: install it in a venv of its own and pass its command:

    python3 -m venv ~/.cache/tachyllm-bench/lmeval
    ~/.cache/tachyllm-bench/lmeval/bin/pip install "lm-eval[api]==0.4.13"
    .venv/bin/python benchmarks/lm_eval_bench.py --lm-eval ~/.cache/tachyllm-bench/lmeval/bin/lm_eval
    .venv/bin/python benchmarks/lm_eval_bench.py --lm-eval ... --base-url http://127.0.0.1:8000

Without --base-url it starts `tachy serve` on the default model (extra flags after `--`) and stops it
at the end.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HELDOUT = Path(__file__).resolve().parent.parent / "tachyllm" / "data" / "heldout.txt"
MC_TASK, GEN_TASK = "tachy_heldout_mc", "tachy_heldout_next_word"


def sentences(text: str) -> list[list[str]]:
    """The prose sentences of the held-out text (its code and tables left out), as word lists."""
    out, seen = [], set()
    for para in re.split(r"\n\s*\n", text):
        if not re.match(r"[A-Z]", para) or any(c in para for c in "{}[]=<>|#`_$\\"):
            continue
        for s in re.split(r"(?<=[.!?])\s+", " ".join(para.split())):
            words = s.split()
            if 8 <= len(words) <= 40 and s not in seen and re.search(r"[a-z]", s):
                seen.add(s)
                out.append(words)
    return out


def build_tasks(directory: Path, limit: int, seed: int) -> tuple[int, int]:
    """The two tasks' jsonl files and YAML configs (JSON, which YAML reads) in `directory`."""
    rng = random.Random(seed)
    sents = sentences(HELDOUT.read_text())
    rng.shuffle(sents)
    sents = sents[:limit]
    cut = [max(4, len(w) // 2) for w in sents]
    mc, gen = [], []
    for i, (words, k) in enumerate(zip(sents, cut)):
        others = rng.sample([j for j in range(len(sents)) if j != i], 3)
        endings = [" ".join(words[k:])] + [" ".join(sents[j][cut[j] :]) for j in others]
        order = list(range(4))
        rng.shuffle(order)
        mc.append({"context": " ".join(words[:k]), "choices": [endings[o] for o in order], "label": order.index(0)})
        target = re.sub(r"[^\w']", "", words[k])
        if target:
            gen.append({"context": " ".join(words[:k]), "target": target})
    for name, docs in (("mc", mc), ("gen", gen)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = {"dataset_path": "json", "test_split": "test"}
    configs = {
        MC_TASK: {
            **common,
            "dataset_kwargs": {"data_files": {"test": str(directory / "mc.jsonl")}},
            "output_type": "multiple_choice",
            "doc_to_text": "context",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [
                {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")
            ],
        },
        GEN_TASK: {
            **common,
            "dataset_kwargs": {"data_files": {"test": str(directory / "gen.jsonl")}},
            "output_type": "generate_until",
            "doc_to_text": "context",
            "doc_to_target": "target",
            "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False, "temperature": 0},
            "filter_list": [
                {
                    "name": "first_word",
                    "filter": [
                        {"function": "regex", "regex_pattern": r"([\w']+)", "group_select": 0},
                        {"function": "take_first"},
                    ],
                }
            ],
            "metric_list": [
                {
                    "metric": "exact_match",
                    "aggregation": "mean",
                    "higher_is_better": True,
                    "ignore_case": True,
                    "ignore_punctuation": True,
                }
            ],
        },
    }
    for task, config in configs.items():
        (directory / f"{task}.yaml").write_text(json.dumps({"task": task, **config}, indent=1))
    return len(mc), len(gen)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tachy = str(Path(sys.executable).with_name("tachy"))
    proc = subprocess.Popen([tachy, "serve", "--port", str(port), *flags])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tachy serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=10):
                return proc, base
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("tachy serve did not become healthy in 600 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default="lm_eval", help="the lm_eval command (of its own venv)")
    ap.add_argument("--base-url", help="a running server; default: start `tachy serve` on the default model")
    ap.add_argument("--model", help="the served model name; default: the server's first")
    ap.add_argument("--limit", type=int, default=80, help="documents per task (at most the sentences found)")
    ap.add_argument("--num-concurrent", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", help="where lm-eval writes its results (default: a temporary folder)")
    ap.add_argument("serve_flags", nargs="*", help="after --: flags for tachy serve")
    args = ap.parse_args()

    proc = None
    base = args.base_url
    if base is None:
        proc, base = start_server(args.serve_flags)
    base = base.rstrip("/")
    try:
        model = args.model or get_json(f"{base}/v1/models")["data"][0]["id"]
        with tempfile.TemporaryDirectory(prefix="tachy-lmeval-") as tmp:
            tasks_dir = Path(tmp) / "tasks"
            tasks_dir.mkdir()
            num_mc, num_gen = build_tasks(tasks_dir, args.limit, args.seed)
            output = args.output or str(Path(tmp) / "out")
            model_args = (
                f"base_url={base}/v1/completions,model={model},tokenizer_backend=remote,"
                f"num_concurrent={args.num_concurrent},max_retries=1,timeout=600"
            )
            command = [
                args.lm_eval, "run", "--model", "local-completions", "--model_args", model_args,
                "--tasks", f"{MC_TASK},{GEN_TASK}", "--include_path", str(tasks_dir), "--output_path", output,
            ]  # fmt: skip
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            env.setdefault("HF_DATASETS_CACHE", str(Path(tmp) / "datasets"))
            print("$", " ".join(command), flush=True)
            start = time.perf_counter()
            subprocess.run(command, env=env, check=True)
            seconds = time.perf_counter() - start
            [path] = glob.glob(f"{output}/**/results_*.json", recursive=True)
            results = json.loads(Path(path).read_text())["results"]
        print(f"\nlm-eval {seconds:.0f} s; {num_mc} multiple-choice documents, {num_gen} generation documents")
        for task, metrics in results.items():
            for name, value in metrics.items():
                if isinstance(value, float) and "stderr" not in name:
                    err = metrics.get(name.replace(",", "_stderr,", 1))
                    print(f"  {task:26s} {name:28s} {value:.4f}" + (f" ± {err:.4f}" if isinstance(err, float) else ""))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
