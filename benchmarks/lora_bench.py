"""LoRA adapters against the base model on the default model, side by side in one run.

Rank-16 adapters on all seven projections (random, at the scale of trained ones: A as PEFT
initialises it, B of the size a few hundred training steps give it), written in PEFT's format:
  - single stream, one adapter: 32-token prompt, 128 new tokens, decode tokens/s (the median of 3
    generations per round, the engines taking turns), for bf16 weights and the GGUF's own Q4_1
    weights (`--quantization gguf`);
  - offline: 64 prompts x 128 tokens, 128 new tokens each, over 8 distinct adapters (8 prompts
    each, `--max-loras 8`), output tokens/s, prefill included.
The base model runs on an engine without `enable_lora` (its fused decoder layers on). Both engines
are loaded in the same process and take turns for --rounds rounds; each figure is printed as the
range over rounds (after one untimed round), each ratio from the same round's pair. Greedy, EOS ignored.

    .venv/bin/python benchmarks/lora_bench.py --threads 2 [--rounds 2] [--profile]
        [--vllm-python ~/.cache/tachyllm-bench/vllm-venv/bin/python]

--profile adds, per weight format, a decode step's time in the base linears, the LoRA kernel (shrink
and expand) and the grouping of the step's rows by adapter, each timed alone on the engine's modules
(one row of one adapter; --batch rows over the adapters).

--vllm-python runs the offline workload on vLLM's CPU build too (competitors/vllm_lora.py in the venv
that competitors/setup_vllm.sh makes, on the bf16 Hugging Face folder it converts): the same prompts
and adapter folders, a base engine and an `--enable-lora` one, one vLLM round after each of the bf16
rounds here (its first run is an 8-token warm-up at its start), with the same thread count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tachyllm import LLM, SamplingParams
from tachyllm.lora.peft import TARGET_MODULES, projection_shapes
from tachyllm.lora.request import LoRARequest
from tachyllm.model_config import ModelConfig
from tachyllm.step import ScheduledSeq

sys.path.insert(0, str(Path(__file__).parent / "competitors"))
from round_process import RoundProcess, vllm_env  # noqa: E402

RANK, ALPHA = 16, 32
BENCH_CACHE = Path(os.environ.get("TACHY_BENCH_CACHE", Path.home() / ".cache" / "tachyllm-bench"))


def write_adapter(directory: Path, cfg: ModelConfig, seed: int) -> Path:
    """A rank-16 adapter on all seven projections in PEFT's format: A uniform in ±1/sqrt(in) as PEFT's
    Kaiming init draws it, B normal with std 0.01 (PEFT starts B at zero; training moves it to about
    this size), so that scale · B · A changes each output by about a percent of the base weights'."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, (fan_in, fan_out) in projection_shapes(cfg).items():
            module = "self_attn" if proj in TARGET_MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            bound = fan_in**-0.5
            tensors[f"{key}.lora_A.weight"] = (torch.rand(RANK, fan_in, generator=gen) * 2 - 1) * bound
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.01
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGET_MODULES),
              "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None}  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    return directory


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


# Single-stream generations per engine and round, the two engines taking turns; the round keeps each
# engine's median (one 128-token generation moved by ±15% from the next on the shared VM).
SINGLE_REPEATS = 3


def single_stream(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> float:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    out = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0]
    return 1.0 / out.metrics.mean_tpot


def single_streams(base: LLM, lora: LLM, prompt: list[int], adapter: LoRARequest) -> tuple[float, float]:
    """The base's and the adapter's single-stream decode tok/s, each the median of SINGLE_REPEATS."""
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(SINGLE_REPEATS):
        runs[0].append(single_stream(base, prompt, None))
        runs[1].append(single_stream(lora, prompt, adapter))
    return statistics.median(runs[0]), statistics.median(runs[1])


def offline(llm: LLM, batch: list[list[int]], loras: list[LoRARequest] | None) -> float:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params, lora_request=loras, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def step_profile(llm: LLM, slots: list[int], rows_per_slot: int, repeats: int = 20) -> dict[str, float]:
    """Milliseconds per step, over every decoder layer, of the base linears, the LoRA kernel (shrink and
    expand) and the step's grouping by adapter (StepSegments.set_step), each timed alone on the engine's
    own modules with `rows_per_slot` decode rows per adapter slot."""
    manager = llm.engine.lora
    assert manager is not None
    shapes = projection_shapes(manager.model_config)
    first = ("q_proj", "o_proj", "gate_proj", "down_proj")  # one projection of each wrapped linear
    step = [
        ScheduledSeq(
            seq_id=i,
            request_id=str(i),
            start=0,
            token_ids=[1],
            num_draft_tokens=0,
            block_table=[],
            seq_len=1,
            completes=True,
            lora_slot=slot,
        )  # fmt: skip
        for i, slot in enumerate(s for s in slots for _ in range(rows_per_slot))
    ]
    rows = len(step)
    times = {"base linears": 0.0, "LoRA shrink + expand": 0.0, "grouping by adapter": 0.0}
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(repeats):
            manager.segments.set_step(step)
        times["grouping by adapter"] = (time.perf_counter() - start) / repeats
        for wrappers in manager.layers:
            for proj in first:
                wrapper = wrappers[proj]
                x = torch.randn(rows, shapes[proj][0]).to(llm.engine.dtype)
                out = wrapper.base(x)
                start = time.perf_counter()
                for _ in range(repeats):
                    wrapper.base(x)
                middle = time.perf_counter()
                for _ in range(repeats):
                    wrapper.native.apply(out, x, manager.segments.native)
                end = time.perf_counter()
                times["base linears"] += (middle - start) / repeats
                times["LoRA shrink + expand"] += (end - middle) / repeats
        manager.segments.set_step([])
    return {k: v * 1e3 for k, v in times.items()}


def start_vllm(args: argparse.Namespace, workdir: Path, batch: list[list[int]], adapters: list[LoRARequest],
               notes: list[str]) -> RoundProcess:  # fmt: skip
    """vLLM's side of the offline workload (competitors/vllm_lora.py), set up and warmed up."""
    prompt_file = workdir / "prompts.json"
    prompt_file.write_text(json.dumps(batch))
    script = Path(__file__).parent / "competitors" / "vllm_lora.py"
    command = [str(args.vllm_python), str(script), "--model", str(args.vllm_model), "--prompts", str(prompt_file),
               "--max-lora-rank", str(RANK), "--adapters", *(a.lora_path for a in adapters)]  # fmt: skip
    vllm = RoundProcess(command, workdir / "vllm.log", vllm_env(args.threads or os.cpu_count() or 1))
    notes.append(f"vLLM {vllm.ready['vllm']} (log: {vllm.log_path})")
    if vllm.ready["lora_error"]:
        notes.append(f"vLLM's LoRA engine did not start: {vllm.ready['lora_error']}")
    return vllm


def vllm_round(vllm: RoundProcess, results: dict[str, list[float | None]], notes: list[str]) -> None:
    """One vLLM round; a failed LoRA run counts as None and its error is noted once."""
    answer = vllm.round()
    results["base"].append(answer["base"])
    results["lora"].append(answer["lora"])
    if answer["lora"] is None and answer["lora_error"] not in " ".join(notes):
        notes.append(f"vLLM's LoRA run failed: {answer['lora_error']}")
    lora = "failed" if answer["lora"] is None else f"{answer['lora']:.1f}"
    print(f"vLLM: base N {answer['base']:.1f}, lora N {lora}", flush=True)


def print_versus_vllm(
    tachy: dict[str, list[float]], vllm: dict[str, list[float | None]], notes: list[str], label: str
) -> None:
    """The offline bf16 workload on both engines; tachyllm / vLLM from the same round's pair."""
    print("\n" + "; ".join(notes))
    print(f"| {label} | base tok/s | LoRA tok/s | LoRA / base | tachyllm / vLLM, base | tachyllm / vLLM, LoRA |")
    print("|---|---|---|---|---|---|")
    tb, tl = tachy["base N"], tachy["lora N"]
    vb = [v for v in vllm["base"] if v is not None]
    ran = [i for i, v in enumerate(vllm["lora"]) if v is not None]  # the rounds whose vLLM LoRA run finished
    vl = [v for v in vllm["lora"] if v is not None]
    print(f"| tachyllm | {ranged(tb)} | {ranged(tl)} | {ratio_range(tl, tb)} | | |")
    if not ran:
        print(f"| vLLM CPU | {ranged(vb)} | does not run | - | {ratio_range(tb, vb)} | - |")
        return
    own = ratio_range(vl, [vb[i] for i in ran])
    print(f"| vLLM CPU | {ranged(vb)} | {ranged(vl)} | {own} | {ratio_range(tb, vb)} | "
          f"{ratio_range([tl[i] for i in ran], vl)} |")  # fmt: skip


def ratio_range(numerators: list[float], denominators: list[float]) -> str:
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def ranged(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--skip", choices=["bf16", "gguf", "offline"], action="append", default=[])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--vllm-python", type=Path, help="the Python of vLLM's CPU venv (competitors/setup_vllm.sh)")
    ap.add_argument("--vllm-model", type=Path, default=BENCH_CACHE / "smollm2-135m-hf",
                    help="the default model as a Hugging Face folder, for vLLM")  # fmt: skip
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    rows = []
    versus_vllm: dict[str, list[float | None]] = {"base": [], "lora": []}
    vllm_notes: list[str] = []
    workloads = [(w, q) for w, q in (("bf16", None), ("gguf", "gguf")) if w not in args.skip]
    for name, quantization in workloads:
        common = dict(dtype="bfloat16", quantization=quantization, threads=args.threads, max_num_seqs=args.batch,
                      max_num_batched_tokens=4096)  # fmt: skip
        base = LLM(**common)
        lora = LLM(**common, enable_lora=True, max_loras=args.adapters, max_cpu_loras=args.adapters)
        cfg = lora.engine.model_config
        adapters = [
            LoRARequest(f"a{i}", i + 1, str(write_adapter(workdir / f"a{i}", cfg, seed=i)))
            for i in range(args.adapters)
        ]
        one, batch = prompts(1, 32, cfg.vocab_size, 0)[0], prompts(args.batch, 128, cfg.vocab_size, 1)
        mixed = [adapters[i % len(adapters)] for i in range(len(batch))]
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        base.generate([one], warm, use_tqdm=False)
        lora.generate(batch[: len(adapters)], warm, lora_request=adapters, use_tqdm=False)  # loads every adapter
        results: dict[str, list[float]] = {k: [] for k in ("base 1", "lora 1", "base N", "lora N")}
        vllm = None
        if args.vllm_python and name == "bf16" and "offline" not in args.skip:
            vllm = start_vllm(args, workdir, batch, adapters, vllm_notes)
        # A first round untimed: the first runs of each engine were several times slower than the
        # next ones (2.9 and 7.9 base single-stream tok/s, then 87).
        try:
            for round_index in range(args.rounds + 1):
                if round_index == 1:
                    results = {k: [] for k in results}
                base_rate, lora_rate = single_streams(base, lora, one, adapters[0])
                results["base 1"].append(base_rate)
                results["lora 1"].append(lora_rate)
                if "offline" not in args.skip:
                    results["base N"].append(offline(base, batch, None))
                    results["lora N"].append(offline(lora, batch, mixed))
                print(f"{name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items() if v), flush=True)
                if vllm is not None and round_index > 0:
                    vllm_round(vllm, versus_vllm, vllm_notes)
        finally:
            if vllm is not None:
                vllm.close()
        rows.append((name, results))
        if args.profile:
            slots = [lora.engine.lora.loaded[a].slot for a in adapters]
            for label, step_slots, per_slot in (("decode, 1 row of 1 adapter", slots[:1], 1),
                                                (f"decode, {args.batch} rows of {len(slots)} adapters", slots,
                                                 args.batch // len(slots))):  # fmt: skip
                profile = step_profile(lora, step_slots, per_slot)
                print(f"{name}, {label}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in profile.items()))
        del base, lora
        gc.collect()

    print(f"default model, rank {RANK} on all seven projections, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds (ranges), torch {torch.__version__}")  # fmt: skip
    print("| weights | workload | base tok/s | LoRA tok/s | LoRA / base, median (range) |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        for key, label in (("1", "single stream, one adapter, decode"),
                           ("N", f"offline {args.batch} x 128/128, {args.adapters} adapters, output")):  # fmt: skip
            b, a = r[f"base {key}"], r[f"lora {key}"]
            if not b:
                continue
            ratios = [y / x for x, y in zip(b, a)]
            print(f"| {name} | {label} | {ranged(b)} | {ranged(a)} | {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")  # fmt: skip
    if args.vllm_python:
        tachy = next((r for name, r in rows if name == "bf16"), None)
        if tachy is not None:
            label = f"bf16, offline {args.batch} x 128/128, {args.adapters} adapters"
            print_versus_vllm(tachy, versus_vllm, vllm_notes, label)


if __name__ == "__main__":
    main()
