"""LoRA adapters against the base model on the default model, side by side in one run.

Rank-16 adapters on all seven projections (random, at the scale of trained ones: A as PEFT
initialises it, B of the size a few hundred training steps give it), written in PEFT's format:
  - single stream, one adapter: 32-token prompt, 128 new tokens, decode tokens/s, for bf16 weights
    and the GGUF's own Q4_1 weights (`--quantization gguf`);
  - offline: 64 prompts x 128 tokens, 128 new tokens each, over 8 distinct adapters (8 prompts
    each, `--max-loras 8`), output tokens/s, prefill included.
The base model runs on an engine without `enable_lora` (its fused decoder layers on). Both engines
are loaded in the same process and take turns for --rounds rounds; each figure is printed as the
range over rounds (after one untimed round), each ratio from the same round's pair. Greedy, EOS ignored.

    .venv/bin/python benchmarks/lora_bench.py --threads 2 [--rounds 2] [--profile]

--profile adds, per weight format, a decode step's time in the base linears, the LoRA kernel (shrink
and expand) and the grouping of the step's rows by adapter, each timed alone on the engine's modules
(one row of one adapter; --batch rows over the adapters).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
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

RANK, ALPHA = 16, 32


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


def single_stream(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> float:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    out = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0]
    return 1.0 / out.metrics.mean_tpot


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
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    rows = []
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
        # A first round untimed: the first runs of each engine were several times slower than the
        # next ones (2.9 and 7.9 base single-stream tok/s, then 87).
        for round_index in range(args.rounds + 1):
            if round_index == 1:
                results = {k: [] for k in results}
            results["base 1"].append(single_stream(base, one, None))
            results["lora 1"].append(single_stream(lora, one, adapters[0]))
            if "offline" not in args.skip:
                results["base N"].append(offline(base, batch, None))
                results["lora N"].append(offline(lora, batch, mixed))
            print(f"{name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items() if v), flush=True)
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
    print("| weights | workload | base tok/s | LoRA tok/s | LoRA / base |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        for key, label in (("1", "single stream, one adapter, decode"),
                           ("N", f"offline {args.batch} x 128/128, {args.adapters} adapters, output")):  # fmt: skip
            b, a = r[f"base {key}"], r[f"lora {key}"]
            if not b:
                continue
            ratios = [y / x for x, y in zip(b, a)]
            print(f"| {name} | {label} | {ranged(b)} | {ranged(a)} | {min(ratios):.2f}-{max(ratios):.2f}x |")


if __name__ == "__main__":
    main()
