"""Performance under co-tenancy: tachyllm and llama.cpp, quiet and beside a CPU-bound process.

Both engines run the same GGUF file (the embedded SmolLM2-135M-Instruct, Q4_1): tachyllm with
`--quantization gguf` (its Q4_1 kernels; 8-bit activations by default, llama.cpp's Q8_1 rounding),
llama.cpp through llama-cpp-python's C API (built by benchmarks/competitors/setup_llamacpp.sh into
$TACHY_BENCH_CACHE/llamacpp-venv, default ~/.cache/tachyllm-bench). Workloads, as in
cpu_fast_path_bench.py: single stream (32-token prompt, 128 new tokens, decode tokens/s, median of
--repeats) and offline batch (64 prompts x 128 tokens, 128 new tokens each, output tokens/s with
prefill). Greedy, EOS ignored, the same random token ids for both engines.

Conditions: quiet, and loaded: --burners busy-loop processes (`python -c 'while True: pass'`,
same priority, no pinning) started before and stopped after each measurement. Every measurement
is a fresh subprocess (fresh OpenMP / ggml thread pools); rounds alternate the engine order and the
condition order. Before each measurement the script waits (up to --wait-idle s) until no other
process uses >= 10% CPU, and records the load average and the busy processes before and after, so
that a run disturbed by someone else's job can be told apart.

    .venv/bin/python benchmarks/cotenancy_bench.py            # ~25 min on 2 Zen 3 cores (prefill-bound batches)
    .venv/bin/python benchmarks/cotenancy_bench.py --quick    # ~5 min: 16 x 64/64 batches, 2 repeats
    # tachyllm variants beside the default (thread count, OpenMP settings), e.g. (tachyllm only, quick):
    .venv/bin/python benchmarks/cotenancy_bench.py --engines tachy --quick --variant t1:threads=1 \\
        --variant spin300:GOMP_SPINCOUNT=300 --variant passive:OMP_WAIT_POLICY=PASSIVE \\
        --variant nobind:omp_threads_bind=nobind
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("TACHY_BENCH_CACHE", Path.home() / ".cache" / "tachyllm-bench"))
LLAMACPP_PYTHON = CACHE / "llamacpp-venv" / "bin" / "python"
BURNER = "while True: pass"


# ---------------------------------------------------------------- workers (one measurement each)


def worker_tachy(spec: dict) -> dict:
    import torch
    from cpu_fast_path_bench import batch, single_stream

    from tachyllm import LLM

    t0 = time.perf_counter()
    llm = LLM(spec["gguf"], dtype="bfloat16", quantization="gguf", quant_activation_bits=spec["activation_bits"],
              threads=spec.get("threads"), max_num_seqs=max(spec["batch"], 1), max_num_batched_tokens=4096,
              **spec.get("options", {}))  # fmt: skip
    load_s = time.perf_counter() - t0
    out = {"threads": torch.get_num_threads(), "load_s": load_s}
    out["single"] = single_stream(llm, spec["single_prompt"], spec["single_new"], spec["repeats"])
    if spec["batch"]:
        out["batch"] = batch(llm, spec["batch_prompts"], spec["new"])
    return out


def worker_llamacpp(spec: dict) -> dict:
    """llama.cpp's own decode loop through llama-cpp-python's C bindings: one context, sequences as
    seq ids in one llama_batch (as llama.cpp's `batched` example and llama-server's slots do), greedy
    argmax in numpy. The high-level Llama class runs one sequence at a time."""
    import ctypes

    import llama_cpp as L
    import numpy as np

    quiet_log = L.llama_log_callback(lambda level, text, data: None)  # kept referenced: llama.cpp calls it later
    L.llama_log_set(quiet_log, ctypes.c_void_p(0))
    L.llama_backend_init()
    t0 = time.perf_counter()
    model = L.llama_model_load_from_file(spec["gguf"].encode(), L.llama_model_default_params())
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    threads = spec.get("threads") or len(os.sched_getaffinity(0))

    def context(n_seq: int, tokens_per_seq: int):
        cp = L.llama_context_default_params()
        cp.n_ctx = n_seq * tokens_per_seq
        cp.n_batch, cp.n_ubatch, cp.n_seq_max = 2048, 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False  # llama.h: faster for sequences that share no prefix
        return L.llama_init_from_model(model, cp)

    def generate(ctx, seqs: list[list[int]], new: int) -> tuple[float, float, list[list[int]]]:
        """Prefill every prompt, then `new` tokens each; returns (seconds, seconds after the first token, tokens)."""
        cap = max(2048, len(seqs))
        b = L.llama_batch_init(cap, 0, 1)
        try:
            start = time.perf_counter()
            pending = [(s, p, tok, p == len(seq) - 1) for s, seq in enumerate(seqs) for p, tok in enumerate(seq)]
            nxt = [0] * len(seqs)
            for i in range(0, len(pending), cap):
                chunk = pending[i : i + cap]
                for j, (s, p, tok, last) in enumerate(chunk):
                    b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, p, 1, last
                    b.seq_id[j][0] = s
                b.n_tokens = len(chunk)
                if L.llama_decode(ctx, b) != 0:
                    raise RuntimeError("llama_decode failed (prefill)")
                for j, (s, _, _, last) in enumerate(chunk):
                    if last:
                        nxt[s] = int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, j), shape=(vocab,))))
            first = time.perf_counter()
            made = [[t] for t in nxt]
            for step in range(new - 1):
                for s, seq in enumerate(seqs):
                    b.token[s], b.pos[s], b.n_seq_id[s], b.logits[s] = nxt[s], len(seq) + step, 1, True
                    b.seq_id[s][0] = s
                b.n_tokens = len(seqs)
                if L.llama_decode(ctx, b) != 0:
                    raise RuntimeError("llama_decode failed (decode)")
                logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(seqs), vocab))
                nxt = logits.argmax(axis=1).tolist()
                for s, t in enumerate(nxt):
                    made[s].append(t)
            end = time.perf_counter()
            return end - start, end - first, made
        finally:
            L.llama_batch_free(b)

    out = {"threads": threads}
    ctx = context(1, 32 + spec["single_new"] + 16)
    out["load_s"] = time.perf_counter() - t0
    one = [spec["single_prompt"]]
    generate(ctx, [one[0][:8]], 8)  # warm-up, as single_stream does
    rates = []
    for _ in range(spec["repeats"]):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        rates.append((spec["single_new"] - 1) / generate(ctx, one, spec["single_new"])[1])
    out["single"] = statistics.median(rates)
    L.llama_free(ctx)
    if spec["batch"]:
        ctx = context(spec["batch"], -(-(spec["prompt_len"] + spec["new"]) // 256) * 256)
        total, _, _ = generate(ctx, spec["batch_prompts"], spec["new"])
        out["batch"] = spec["batch"] * spec["new"] / total
        L.llama_free(ctx)
    L.llama_model_free(model)
    return out


# ---------------------------------------------------------------- orchestration


def machine_snapshot(exclude: set[int]) -> dict:
    """Load average and the other processes using CPU right now (top's second sample, 0.5 s apart)."""
    snap = {"loadavg": os.getloadavg()}
    try:
        top = ["top", "-bn2", "-d0.5", "-w", "200"]
        text = subprocess.run(top, check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return snap
    lines = text.stdout.split("\ntop - ")[-1].splitlines()
    header = next((i for i, line in enumerate(lines) if line.lstrip().startswith("PID")), None)
    busy = []
    for line in lines[header + 1 :] if header is not None else []:
        f = line.split(None, 11)
        if len(f) == 12 and f[0].isdigit() and int(f[0]) not in exclude and float(f[8].replace(",", ".")) >= 10:
            busy.append(f"{f[11][:40]} {float(f[8]):.0f}%")
    snap["busy"] = busy
    return snap


def wait_idle(limit_s: float) -> float:
    """Waits (up to limit_s) until no other process uses >= 10% CPU; returns the seconds waited."""
    t0 = time.perf_counter()
    while limit_s > 0 and machine_snapshot({os.getpid()}).get("busy") and time.perf_counter() - t0 < limit_s:
        time.sleep(5)
    return time.perf_counter() - t0


def run_one(engine: str, spec: dict, env: dict, burners: int, timeout: float, idle_s: float) -> dict:
    python = str(LLAMACPP_PYTHON) if engine == "llamacpp" else sys.executable
    waited = wait_idle(idle_s)
    procs = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(burners)]
    try:
        if procs:
            time.sleep(1.0)  # let the scheduler see the burners as CPU-bound
        snap = machine_snapshot({os.getpid(), *(p.pid for p in procs)})
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        res = subprocess.run([python, __file__, "--worker", engine], input=json.dumps(spec), env=env,
                             check=False, capture_output=True, text=True, timeout=timeout)  # fmt: skip
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # before the burners are reaped: the worker's alone
    finally:
        for p in procs:
            p.kill()
            p.wait()
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} worker failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT ") :])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out.update(wall_s=wall, cpu_s=cpu, sys_s=after.ru_stime - before.ru_stime, snapshot=snap, waited_s=waited,
               after=machine_snapshot({os.getpid()}))  # fmt: skip
    return out


def parse_variant(text: str) -> tuple[str, dict, int | None, dict]:
    """NAME:KEY=VAL,KEY=VAL -> (name, env, threads, options); `threads` is tachyllm's threads=, other
    lower-case keys its other engine options (e.g. omp_threads_bind=nobind), upper-case keys env vars."""
    name, _, rest = text.partition(":")
    env, threads, options = {}, None, {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key == "threads":
            threads = int(value)
        elif key.islower():
            options[key] = value
        else:
            env[key] = value
    return name, env, threads, options


def fmt_range(values: list[float]) -> str:
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["tachy", "llamacpp"], help=argparse.SUPPRESS)
    ap.add_argument("--engines", default="tachy,llamacpp", help="comma list of tachy, llamacpp")
    ap.add_argument("--variant", action="append", default=[],
                    help="extra tachyllm run NAME:KEY=VAL,...; threads=N, other engine options (lower case, e.g. "
                         "omp_threads_bind=nobind) or environment variables (e.g. OMP_WAIT_POLICY=PASSIVE, "
                         "GOMP_SPINCOUNT=10000)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None,
                    help="compute threads of both engines (default: tachyllm's default_threads())")  # fmt: skip
    ap.add_argument("--burners", type=int, default=1, help="busy-loop processes in the loaded condition")
    ap.add_argument("--conditions", default="quiet,loaded")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="single-stream runs per measurement (median)")
    ap.add_argument("--batch", type=int, default=64, help="offline batch size; 0 = single stream only")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128, help="new tokens per batch sequence")
    ap.add_argument("--single-new", type=int, default=128)
    ap.add_argument("--activation-bits", type=int, default=8, choices=[8, 16], help="tachyllm --quant-activation-bits")
    ap.add_argument("--quick", action="store_true", help="16 x 64/64 batches, 2 repeats")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--wait-idle", type=float, default=120,
                    help="before each measurement, wait up to this many s until no other process is busy")  # fmt: skip
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()

    if args.worker:
        fn = worker_tachy if args.worker == "tachy" else worker_llamacpp
        print("RESULT " + json.dumps(fn(json.loads(sys.stdin.read()))), flush=True)
        return
    if args.quick:
        args.batch, args.prompt_len, args.new, args.repeats = min(args.batch, 16), 64, 64, 2

    import gguf
    from cpu_fast_path_bench import prompts

    from tachyllm.loading.default_model import default_model_path
    from tachyllm.platform import available_cpus, default_threads

    path = default_model_path()
    vocab = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    spec = {"gguf": path, "batch": args.batch, "prompt_len": args.prompt_len, "new": args.new,
            "single_new": args.single_new, "repeats": args.repeats, "activation_bits": args.activation_bits,
            "single_prompt": prompts(1, 32, vocab, 0)[0],
            "batch_prompts": prompts(args.batch, args.prompt_len, vocab, 1)}  # fmt: skip
    runs: list[tuple[str, str, dict, int | None, dict]] = []  # (label, engine, env, threads, engine options)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "tachy" in engines:
        runs.append(("tachyllm", "tachy", {}, args.threads, {}))
        for v in args.variant:
            name, env, threads, options = parse_variant(v)
            runs.append((f"tachyllm {name}", "tachy", env, threads if threads is not None else args.threads, options))
    if "llamacpp" in engines:
        if LLAMACPP_PYTHON.exists():
            runs.append(("llama.cpp", "llamacpp", {}, args.threads or default_threads(), {}))
        else:
            print(f"llama.cpp skipped: no {LLAMACPP_PYTHON} (run benchmarks/competitors/setup_llamacpp.sh)")
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]

    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {os.cpu_count()} CPUs, {available_cpus()} usable; "
          f"default threads {default_threads()}; start: {machine_snapshot({os.getpid()})}", flush=True)  # fmt: skip
    results: list[dict] = []
    for r in range(args.rounds):
        conds = conditions if r % 2 == 0 else conditions[::-1]
        for cond in conds:
            order = runs if r % 2 == 0 else runs[::-1]
            for label, engine, env, threads, options in order:
                burners = args.burners if cond == "loaded" else 0
                run_env = {**os.environ, **env}
                run_spec = {**spec, "threads": threads, "options": options}
                out = run_one(engine, run_spec, run_env, burners, args.timeout, args.wait_idle)
                out.update(label=label, condition=cond, round=r)
                results.append(out)
                snap = out["snapshot"]
                print(f"round {r} {cond:6s} {label:22s} threads {out['threads']}: single {out['single']:6.1f} tok/s"
                      + (f", batch {out['batch']:6.1f} tok/s" if "batch" in out else "")
                      + f"  (wall {out['wall_s']:.0f} s, cpu {out['cpu_s']:.0f} s, sys {out['sys_s']:.1f} s; "
                      f"waited {out['waited_s']:.0f} s; load {snap['loadavg'][0]:.2f}, other busy before: "
                      f"{', '.join(snap.get('busy', [])) or 'none'}, "
                      f"after: {', '.join(out['after'].get('busy', [])) or 'none'})",
                      flush=True)  # fmt: skip

    batch_head = f"{args.batch} x {args.prompt_len}/{args.new} tok/s"
    print(f"\n| engine | condition | single-stream tok/s | {batch_head} | loaded/quiet single | loaded/quiet batch |")
    print("|---|---|---|---|---|---|")
    for label, *_ in runs:
        med = {}
        for cond in conditions:
            rows = [x for x in results if x["label"] == label and x["condition"] == cond]
            one, many = [x["single"] for x in rows], [x["batch"] for x in rows if "batch" in x]
            med[cond] = (statistics.median(one), statistics.median(many) if many else None)
            ratio_one = ratio_many = ""
            if cond != "quiet" and "quiet" in med:
                q, m = med["quiet"], med[cond]
                ratio_one = f"{m[0] / q[0]:.2f} ({q[0] / m[0]:.1f}x slower)"
                if m[1] and q[1]:
                    ratio_many = f"{m[1] / q[1]:.2f} ({q[1] / m[1]:.1f}x slower)"
            print(f"| {label} | {cond} | {fmt_range(one)} | {fmt_range(many)} | {ratio_one} | {ratio_many} |")
    print("ratios: medians; the loaded condition runs", args.burners, "busy-loop process(es) on the same cores")
    if args.json:
        settings = {k: v for k, v in spec.items() if not k.endswith("_prompt") and not k.endswith("_prompts")}
        Path(args.json).write_text(json.dumps({"spec": settings, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
