"""Start-up time on the default model, from spawning the process until the engine is ready:

LLM():        `python -c "from tachyllm import LLM; LLM()"`, until LLM() returns;
tachy serve:  `tachy serve --port P`, until GET /health first answers 200.

Each is measured in three cache states, interleaved per round so that load from other jobs on the
machine hits all of them alike:
  off     TACHY_CACHE_DIR=off (no checkpoint cache: parse and dequantize the GGUF, as before it);
  first   an empty cache directory (parse, dequantize and write the cache entry);
  cached  the entry written by `first` exists (what every later start sees).

    .venv/bin/python benchmarks/startup_bench.py --rounds 3
    .venv/bin/python benchmarks/startup_bench.py --rounds 3 --what llm --modes first cached
    .venv/bin/python benchmarks/startup_bench.py --breakdown     # where LLM()'s time goes, per mode

--breakdown wraps timers around the steps of a start (found by name; steps that moved are skipped)
and runs LLM() once per mode in a fresh process. Timers nest: load_weights includes the reading
(and, without a cache entry, the dequantizing and writing) of the weights it consumes.

The cache directory is a temporary one (removed at the end); OMP_NUM_THREADS defaults to 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

LLM_CODE = (
    "import logging, time\n"
    "logging.basicConfig(level=logging.INFO)\n"
    "from tachyllm import LLM\n"
    "LLM()\n"
    "print('RETURNED', time.time())\n"
)


def run_llm(env: dict[str, str]) -> tuple[float, str]:
    start = time.time()
    result = subprocess.run([sys.executable, "-c", LLM_CODE], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    returned = float(re.search(r"RETURNED (\S+)", result.stdout).group(1))
    return returned - start, result.stderr


def run_serve(env: dict[str, str]) -> tuple[float, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tachy = str(Path(sys.executable).with_name("tachy"))
    start = time.time()
    proc = subprocess.Popen([tachy, "serve", "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return time.time() - start, _stop(proc)
            except OSError:
                time.sleep(0.02)
            if proc.poll() is not None:
                raise SystemExit(proc.stderr.read())
    finally:
        if proc.poll() is None:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    return proc.communicate(timeout=60)[1]


# (module, attribute path, label) of the steps --breakdown times.
STEPS = [
    ("tachyllm.engine.llm_engine", "load_checkpoint", "load_checkpoint (total)"),
    ("gguf.gguf_reader", "GGUFReader.__init__", "  GGUF parse (GGUFReader)"),
    ("tachyllm.loading.tokenizer", "Tokenizer.from_gguf", "  tokenizer from GGUF metadata"),
    ("tachyllm.loading.cache", "_read", "  cache entry open (config + tokenizer)"),
    # On the meta device nn.Embedding's normal_ init goes through torch._refs, which imports
    # torch._dynamo (~0.9 s) on first use.
    ("tachyllm.models.llama", "LlamaForCausalLM.__init__", "model construction (meta device)"),
    ("torch.nn.modules.module", "Module.to_empty", "model to_empty (allocate)"),
    ("tachyllm.models.llama", "LlamaForCausalLM.to", "model .to(dtype)"),
    ("tachyllm.models.llama", "LlamaForCausalLM.load_weights", "load_weights (reads the weights)"),
    ("tachyllm.loading.gguf", "dequantize", "  dequantize (gguf, numpy)"),
    ("tachyllm.loading.cache", "_Writer.commit", "  cache entry fsync + rename"),
    ("tachyllm.kernels.linear", "PackedLinear.__init__", "oneDNN weight packing"),
    ("tachyllm.backends.base", "Backend.allocate_kv_cache", "KV cache allocation"),
]


def child_breakdown() -> None:
    """Runs LLM() once with timers around STEPS; prints one line per step."""
    import importlib

    t0 = time.perf_counter()
    import torch  # noqa: F401

    t_torch = time.perf_counter()
    from tachyllm import LLM

    t_import = time.perf_counter()
    totals: dict[str, list[float]] = {}
    for module_name, path, label in STEPS:
        try:
            owner = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            original = owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
        except (ImportError, AttributeError, KeyError):
            print(f"{label:42s}   (not found)")
            continue
        func = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original
        record = totals.setdefault(label, [0.0, 0])

        def timed(*a, __func=func, __record=record, **k):
            start = time.perf_counter()
            try:
                return __func(*a, **k)
            finally:
                __record[0] += time.perf_counter() - start
                __record[1] += 1

        setattr(owner, name, classmethod(timed) if isinstance(original, classmethod) else timed)
    t_llm = time.perf_counter()
    LLM()
    done = time.perf_counter()
    print(f"{'import torch':42s} {t_torch - t0:6.2f}")
    print(f"{'import tachyllm (after torch)':42s} {t_import - t_torch:6.2f}")
    for label, (seconds, calls) in totals.items():
        print(
            f"{label:42s} {seconds:6.2f}" + (f"  ({calls} calls)" if calls > 1 else "")
            if calls
            else f"{label:42s}      -"
        )
    print(f"{'LLM() total':42s} {done - t_llm:6.2f}")


def breakdown(modes: list[str]) -> None:
    cache = Path(tempfile.mkdtemp(prefix="tachy-startup-bench-"))
    try:
        for mode in modes:
            if mode == "first":
                shutil.rmtree(cache, ignore_errors=True)
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
            env["TACHY_CACHE_DIR"] = "off" if mode == "off" else str(cache)
            load = Path("/proc/loadavg").read_text().split()[0]
            print(f"\n== {mode} (load average {load})", flush=True)
            subprocess.run([sys.executable, __file__, "--child-breakdown"], env=env, check=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--what", nargs="+", default=["llm", "serve"], choices=["llm", "serve"])
    parser.add_argument("--modes", nargs="+", default=["off", "first", "cached"], choices=["off", "first", "cached"])
    parser.add_argument("--breakdown", action="store_true", help="time the steps of one LLM() start per mode")
    parser.add_argument("--child-breakdown", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_breakdown:
        return child_breakdown()
    if args.breakdown:
        return breakdown(args.modes)
    cache = Path(tempfile.mkdtemp(prefix="tachy-startup-bench-"))
    base_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for round_ in range(1, args.rounds + 1):
            for what in args.what:
                for mode in args.modes:
                    if mode == "first":
                        shutil.rmtree(cache, ignore_errors=True)
                    env = {**base_env, "TACHY_CACHE_DIR": "off" if mode == "off" else str(cache)}
                    load = Path("/proc/loadavg").read_text().split()[0]
                    seconds, log = (run_llm if what == "llm" else run_serve)(env)
                    ready = re.search(r"engine ready in (\S+) s", log)
                    times.setdefault((what, mode), []).append(seconds)
                    print(
                        f"round {round_} {what:5s} {mode:6s} {seconds:6.2f} s "
                        f"(engine ready in {ready.group(1) if ready else '?'} s; load average {load})",
                        flush=True,
                    )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print("\n| start | cache | runs (s) | median (s) |\n|---|---|---|---|")
    for (what, mode), values in times.items():
        label = "`LLM()`" if what == "llm" else "`tachy serve`"
        runs = " / ".join(f"{v:.2f}" for v in values)
        print(f"| {label} | {mode} | {runs} | {statistics.median(values):.2f} |")


if __name__ == "__main__":
    main()
