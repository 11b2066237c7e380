"""tachyllm vs Hugging Face transformers on one CUDA GPU, side by side in one run (random weights).

The default model cannot travel to the GPU machine, so this builds a random-weight model with the
exact shape of SmolLM2-135M-Instruct (LlamaForCausalLM: hidden 576, intermediate 1536, 30 layers,
9 heads, 3 KV heads, head_dim 64, vocab 49152, tied embeddings, rope_theta 100000), bf16, saved
with save_pretrained into a temporary directory together with a synthetic byte-level BPE tokenizer
of the full 49152-token vocabulary (tachyllm's LLM loads tokenizer.json; prompts are token ids).

Measured (greedy, EOS ignored so every request generates exactly its token count):
  1. tachyllm offline batch: 64 prompts x 128 random prompt tokens, 128 output tokens each ->
     output tok/s = generated tokens / wall time of llm.generate (after a smaller warm-up run).
     Also 256 prompts, if the time budget allows.
  2. tachyllm single stream: 1 prompt of 128 tokens, 256 output tokens -> decode tok/s
     (1 / mean time per output token after the first, from the request's metrics) and whole
     generate tok/s (256 / wall time, prefill included).
  3. transformers model.generate on the same weights, bf16, min_new_tokens = max_new_tokens:
     batch 64 (and 256) of equal-length prompts (no padding needed), and batch 1 with 256 new
     tokens (decode tok/s = 256 / (time of 257 new tokens - time of 1 new token); whole = 256 /
     wall time of the 256-token generate).
  4. Ratios tachyllm / transformers for each.

Prints each phase's timing as it goes, then a markdown table and a JSON blob (also written to
$OUT/gpu_bench.json when OUT is set, rewritten after every phase so a cut-off run keeps its
results). Each phase catches its own exception and the run continues. A measured phase predicted
to end past --time-budget seconds (150; single stream and the batch of 256 are estimated from
the same engine's batch of 64) is skipped, so a slow engine cannot stretch the run much.

On the GPU machine, from the repository root with PYTHONPATH set to it:

    python3 benchmarks/gpu_bench.py

CPU smoke test of the same code path:

    .venv/bin/python benchmarks/gpu_bench.py --device cpu --num-layers 2 --num-prompts 4 \\
        --large-num-prompts 8 --input-len 16 --output-len 8 --single-output-len 16 --kv-cache-memory-gib 0.25
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import random
import string
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

os.environ.setdefault("TACHY_CACHE_DIR", "off")  # nothing written to ~/.cache (HF dirs are not cached anyway)

import torch  # noqa: E402

from tachyllm import LLM, SamplingParams  # noqa: E402
from tachyllm.runner.kv_cache import bytes_per_block  # noqa: E402

# SmolLM2-135M-Instruct's config.json, the fields that shape the computation.
SMOLLM2_135M: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    hidden_act="silu",
)
ROPE_THETA = 100000.0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
FIRST_PROMPT_ID = 100  # random prompt ids skip the special tokens
PAD_ID = 2


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--num-layers", type=int, default=30, help="30 = SmolLM2-135M; fewer for a smoke test")
    ap.add_argument("--num-prompts", type=int, default=64, help="offline batch size (both engines)")
    ap.add_argument("--large-num-prompts", type=int, default=256, help="second, larger batch; 0 = skip")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (batch and single stream)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per prompt in the batch runs")
    ap.add_argument("--single-output-len", type=int, default=256, help="output tokens of the single stream")
    ap.add_argument("--warmup-prompts", type=int, default=8)
    ap.add_argument("--warmup-output-len", type=int, default=16)
    ap.add_argument("--kv-cache-memory-gib", type=float, default=4.0, help="tachyllm KV cache size")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tachyllm tokens per step (its default)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--time-budget", type=float, default=150.0, help="seconds; phases predicted to overrun are skipped")
    ap.add_argument("--skip-hf", action="store_true", help="tachyllm only")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


# -- the model ------------------------------------------------------------------------------------


def vocab_tokens(vocab_size: int) -> list[str]:
    """Byte-level BPE token strings: the specials, the 256 single bytes, then ASCII letter words
    (with and without a leading space, 'Ġ'), so every id decodes to clean text."""
    from tokenizers import pre_tokenizers

    tokens = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet())
    seen = set(tokens)
    for length in itertools.count(2):
        for prefix in ("Ġ", ""):
            for letters in itertools.product(string.ascii_lowercase, repeat=length):
                word = prefix + "".join(letters)
                if word not in seen:
                    tokens.append(word)
                    if len(tokens) == vocab_size:
                        return tokens
    raise AssertionError("unreachable")


def build_tokenizer(directory: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json of a byte-level BPE over vocab_tokens (no merges:
    only decoding matters here, since prompts are given as token ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(vocab_tokens(vocab_size))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def build_model(directory: Path, num_layers: int, seed: int) -> dict[str, Any]:
    """Saves a random-weight bf16 LlamaForCausalLM of SmolLM2-135M's shape; returns its config facts."""
    import transformers

    shape = dict(SMOLLM2_135M, num_hidden_layers=num_layers)
    config = transformers.LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    build_tokenizer(directory, shape["vocab_size"])
    saved = json.loads((directory / "config.json").read_text())
    theta = (saved.get("rope_parameters") or {}).get("rope_theta", saved.get("rope_theta"))
    if theta != ROPE_THETA:
        log(f"WARNING: config.json has rope_theta {theta}, not {ROPE_THETA} (both engines read the same file)")
    params = sum(p.numel() for p in model.parameters())
    return {"num_parameters": params, "rope_theta": theta, "config_json": saved}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PROMPT_ID, vocab) for _ in range(length)] for _ in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- tachyllm -------------------------------------------------------------------------------------


def make_llm(path: Path, args: argparse.Namespace) -> LLM:
    return LLM(
        str(path),
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=int(args.kv_cache_memory_gib * 2**30),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        seed=args.seed,
    )


def engine_settings(llm: LLM) -> dict[str, Any]:
    """The EngineConfig the LLM runs with, plus what it derived from it (cache blocks, bytes)."""
    engine = llm.engine
    config = {f.name: getattr(engine.config, f.name) for f in fields(engine.config)}
    config = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in config.items()}
    kv_dtype = engine.runner.kv_caches[0][0].dtype
    block_bytes = bytes_per_block(engine.model_config, engine.config.block_size, kv_dtype)
    bm = engine.block_manager
    return {
        "config": config,
        "resolved_dtype": str(engine.dtype),
        "max_model_len": engine.max_model_len,
        "kv_cache_blocks": bm.num_blocks,
        "kv_cache_tokens": bm.num_blocks * bm.block_size,
        "kv_cache_bytes": bm.num_blocks * block_bytes,
        "kv_cache_dtype": str(kv_dtype),
        "weight_bytes": engine.weight_bytes,
        "native_attention": engine.backend.name == "cpu",
        "torch_threads": torch.get_num_threads(),
    }


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tachy_batch(llm: LLM, prompts: list[list[int]], new: int, device: str) -> dict[str, Any]:
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy(new), use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - start
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats
    return {
        **batch_figures(prompts, new, tokens, seconds),
        "engine_steps_so_far": stats.num_steps,
        "preemptions_so_far": stats.num_preemptions,
        "first_tokens": [o.outputs[0].token_ids[0] for o in outs],
    }


def batch_figures(prompts: list[list[int]], new: int, tokens: int, seconds: float) -> dict[str, Any]:
    return {
        "prompts": len(prompts),
        "generated_tokens": tokens,
        "expected_tokens": len(prompts) * new,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "total_tok_s": (tokens + sum(map(len, prompts))) / seconds,
    }


def tachy_single(llm: LLM, prompt: list[int], new: int, device: str) -> dict[str, Any]:
    sync(device)
    start = time.perf_counter()
    out = llm.generate([prompt], greedy(new), use_tqdm=False)[0]
    sync(device)
    seconds = time.perf_counter() - start
    if out.error:
        raise RuntimeError(out.error)
    tokens = len(out.outputs[0].token_ids)
    tpot = out.metrics.mean_tpot
    return {
        "generated_tokens": tokens,
        "seconds": seconds,
        "whole_tok_s": tokens / seconds,
        "ttft_s": out.metrics.ttft,
        "decode_tok_s": 1.0 / tpot if tpot else None,
    }


# -- transformers ---------------------------------------------------------------------------------


def load_hf(path: Path, args: argparse.Namespace):
    import transformers

    dtype = getattr(torch, args.dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()


def hf_generate(model, prompts: list[list[int]], new: int, device: str) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy generate of exactly `new` tokens per prompt, and the new tokens."""
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    mask = torch.ones_like(ids)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=PAD_ID
        )
    sync(device)
    return time.perf_counter() - start, out[:, ids.shape[1] :]


def hf_batch(model, prompts: list[list[int]], new: int, device: str) -> dict[str, Any]:
    seconds, out = hf_generate(model, prompts, new, device)
    return {**batch_figures(prompts, new, out.numel(), seconds), "first_tokens": out[:, 0].tolist()}


def hf_single(model, prompt: list[int], new: int, device: str) -> dict[str, Any]:
    # The first long generate of a process ran ~3x slower than the next ones (H200, transformers
    # 5.17): it is the warm-up, and the decode rate comes from the two runs after it.
    seconds, out = hf_generate(model, [prompt], new, device)
    prefill, _ = hf_generate(model, [prompt], 1, device)
    longer, _ = hf_generate(model, [prompt], new + 1, device)
    seconds, out = hf_generate(model, [prompt], new, device)
    return {
        "generated_tokens": out.numel(),
        "seconds": seconds,
        "whole_tok_s": out.numel() / seconds,
        "ttft_s": prefill,
        "decode_tok_s": new / (longer - prefill),
    }


# -- the run --------------------------------------------------------------------------------------


class Bench:
    """Runs phases in order, each in its own try/except, recording results and timings as it goes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.perf_counter()
        self.report: dict[str, Any] = {"args": vars(args), "env": environment(args.device), "phases": {}, "errors": {}}
        self.out_file = Path(os.environ["OUT"]) / "gpu_bench.json" if os.environ.get("OUT") else None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def phase(self, name: str, fn: Callable[[], Any], estimate: float | None = None) -> Any:
        """Runs fn; records its result (a dict) and seconds. Skipped when `estimate` seconds would
        overrun the time budget."""
        if estimate is not None and self.elapsed() + estimate > self.args.time_budget:
            log(f"[{self.elapsed():6.1f}s] {name}: skipped (estimated {estimate:.0f} s would overrun the budget)")
            self.report["phases"][name] = {"skipped": f"estimated {estimate:.1f} s"}
            return None
        log(f"[{self.elapsed():6.1f}s] {name} ...")
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as e:
            traceback.print_exc(file=sys.stdout)
            self.report["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"[{self.elapsed():6.1f}s] {name}: FAILED ({type(e).__name__}: {e})")
            self.save()
            return None
        seconds = time.perf_counter() - start
        if isinstance(result, dict):
            self.report["phases"][name] = dict(result, phase_seconds=seconds)
            shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items() if k != "first_tokens"}
            log(f"[{self.elapsed():6.1f}s] {name}: {seconds:.1f} s {json.dumps(shown, default=str)}")
        else:
            self.report["phases"][name] = {"phase_seconds": seconds}
            log(f"[{self.elapsed():6.1f}s] {name}: {seconds:.1f} s")
        self.save()
        return result

    def seconds_of(self, name: str) -> float | None:
        return (self.report["phases"].get(name) or {}).get("seconds")

    def save(self) -> None:
        self.report["elapsed_s"] = self.elapsed()
        if self.out_file is not None:
            self.out_file.parent.mkdir(parents=True, exist_ok=True)
            self.out_file.write_text(json.dumps(self.report, indent=1, default=str))


def environment(device: str) -> dict[str, Any]:
    import transformers

    import tachyllm

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tachyllm": getattr(tachyllm, "__version__", None),
        "device": device,
        "cpu_count": os.cpu_count(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return env


def log(message: str) -> None:
    print(message, flush=True)


@dataclass
class Prompts:
    """Random token-id prompts, a fresh set per run: tachyllm caches prompt prefixes across runs."""

    batch: list[list[int]]
    single: list[int]
    large: list[list[int]]
    warm: list[list[int]]
    single_warm: list[int]
    warm_new: int  # output tokens of the warm-up runs

    @classmethod
    def make(cls, args: argparse.Namespace) -> Prompts:
        vocab, length, seed = SMOLLM2_135M["vocab_size"], args.input_len, args.seed
        return cls(
            batch=random_prompts(args.num_prompts, length, vocab, seed + 1),
            single=random_prompts(1, length, vocab, seed + 2)[0],
            large=random_prompts(args.large_num_prompts, length, vocab, seed + 3),
            warm=random_prompts(min(args.warmup_prompts, args.num_prompts), length, vocab, seed + 4),
            single_warm=random_prompts(1, length, vocab, seed + 5)[0],
            warm_new=min(args.warmup_output_len, args.output_len),
        )


def load_engines(bench: Bench, directory: Path, p: Prompts) -> tuple[LLM | None, Any]:
    """Both engines loaded and warmed up (None where that failed or is skipped)."""
    args = bench.args
    llm = bench.phase("tachyllm_load", lambda: make_llm(directory, args))
    if llm is not None:
        bench.report["engine_settings"] = engine_settings(llm)
        log(f"engine settings: {json.dumps(bench.report['engine_settings'], default=str)}")
        bench.phase("tachyllm_warmup", lambda: tachy_batch(llm, p.warm, p.warm_new, args.device))
        bench.phase("tachyllm_single_warmup", lambda: tachy_single(llm, p.single_warm, p.warm_new, args.device))
    hf = None if args.skip_hf else bench.phase("hf_load", lambda: load_hf(directory, args))
    if hf is not None:
        bench.report["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
        bench.phase("hf_warmup", lambda: hf_batch(hf, p.warm, p.warm_new, args.device))
    return llm, hf


def run(bench: Bench, directory: Path) -> None:
    """Comparable pairs back to back, cheapest information first; the larger batch last."""
    args = bench.args
    if bench.phase("build_model", lambda: build_model(directory, args.num_layers, args.seed)) is None:
        return
    p = Prompts.make(args)
    llm, hf = load_engines(bench, directory, p)
    n, big = args.num_prompts, args.large_num_prompts

    # Guards against a slow engine eating the budget. A batch of n goes ahead unless the budget is
    # spent; the single stream is estimated from its engine's batch (per output token: on a GPU a
    # step of one sequence costs no more than a step of n), the larger batch linearly from n.
    def scaled(name: str, factor: float) -> float:
        return factor * (bench.seconds_of(name) or 0.0)

    per_single = args.single_output_len / args.output_len
    if llm is not None:
        bench.phase(f"tachyllm_batch{n}", lambda: tachy_batch(llm, p.batch, args.output_len, args.device), 0.0)
    if hf is not None:
        bench.phase(f"hf_batch{n}", lambda: hf_batch(hf, p.batch, args.output_len, args.device), 0.0)
    if llm is not None:
        bench.phase("tachyllm_single", lambda: tachy_single(llm, p.single, args.single_output_len, args.device),
                    scaled(f"tachyllm_batch{n}", per_single))  # fmt: skip
    if hf is not None:  # three generates: 1, single_output_len + 1 and single_output_len new tokens
        bench.phase("hf_single", lambda: hf_single(hf, p.single, args.single_output_len, args.device),
                    scaled(f"hf_batch{n}", 2 * per_single))  # fmt: skip
    if big:
        if llm is not None and bench.seconds_of(f"tachyllm_batch{n}") is not None:
            bench.phase(f"tachyllm_batch{big}", lambda: tachy_batch(llm, p.large, args.output_len, args.device),
                        scaled(f"tachyllm_batch{n}", big / n))  # fmt: skip
        if hf is not None and bench.seconds_of(f"hf_batch{n}") is not None:
            bench.phase(f"hf_batch{big}", lambda: hf_batch(hf, p.large, args.output_len, args.device),
                        scaled(f"hf_batch{n}", big / n))  # fmt: skip


def summary_rows(report: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per workload: tachyllm and transformers tok/s and their ratio."""
    phases = report["phases"]
    rows = []

    def add(workload: str, ours: str, theirs: str, key: str) -> None:
        a = (phases.get(ours) or {}).get(key)
        b = (phases.get(theirs) or {}).get(key)
        ratio = a / b if a and b else None
        rows.append({"workload": workload, "tachyllm": a, "transformers": b, "ratio": ratio})

    shape = f"{args.input_len} in / {args.output_len} out"
    for n in (args.num_prompts, args.large_num_prompts):
        if n:
            add(f"offline batch {n} x ({shape}), output tok/s", f"tachyllm_batch{n}", f"hf_batch{n}", "output_tok_s")
    single = f"{args.input_len} in / {args.single_output_len} out"
    add(f"single stream ({single}), decode tok/s", "tachyllm_single", "hf_single", "decode_tok_s")
    add(f"single stream ({single}), whole generate tok/s", "tachyllm_single", "hf_single", "whole_tok_s")
    return rows


def first_token_agreement(report: dict[str, Any], n: int) -> float | None:
    """Share of the batch's prompts whose first greedy token is the same in both engines (a sanity
    check that both run the same model; bf16 near-ties on random weights can flip a few)."""
    ours = (report["phases"].get(f"tachyllm_batch{n}") or {}).get("first_tokens")
    theirs = (report["phases"].get(f"hf_batch{n}") or {}).get("first_tokens")
    if not ours or not theirs:
        return None
    return sum(a == b for a, b in zip(ours, theirs)) / len(ours)


def print_summary(report: dict[str, Any], args: argparse.Namespace) -> None:
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f}"

    env = report["env"]
    log("")
    log(f"## tachyllm vs transformers: {env.get('gpu', args.device)}, torch {env['torch']}, "
        f"transformers {env['transformers']}, {args.dtype}, "
        f"random-weight SmolLM2-135M shape ({args.num_layers} layers)")  # fmt: skip
    log("")
    log("| workload | tachyllm | transformers | tachyllm / transformers |")
    log("|---|---|---|---|")
    for row in report["summary"]:
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        log(f"| {row['workload']} | {fmt(row['tachyllm'])} | {fmt(row['transformers'])} | {ratio} |")
    log("")
    settings = report.get("engine_settings") or {}
    if settings:
        c = settings["config"]
        log(f"tachyllm: max_num_seqs {c['max_num_seqs']}, max_num_batched_tokens {c['max_num_batched_tokens']}, "
            f"block_size {c['block_size']}, KV cache {settings['kv_cache_blocks']} blocks = "
            f"{settings['kv_cache_tokens']} "
            f"tokens ({settings['kv_cache_bytes'] / 2**30:.2f} GiB, {settings['kv_cache_dtype']}), "
            f"prefix caching {c['enable_prefix_caching']}, chunked prefill {c['enable_chunked_prefill']}")  # fmt: skip
    log(f"first-token agreement (batch {args.num_prompts}): {report.get('first_token_agreement')}")
    if report["errors"]:
        log(f"errors: {json.dumps(report['errors'])}")
    log(f"total {report['elapsed_s']:.1f} s")
    log("")
    log("JSON:")
    log(json.dumps(report, default=str))


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tachyllm").setLevel(logging.INFO)
    bench = Bench(args)
    log(f"environment: {json.dumps(bench.report['env'])}")
    with tempfile.TemporaryDirectory(prefix="tachy-gpu-bench-") as tmp:
        try:
            run(bench, Path(tmp))
        finally:
            report = bench.report
            report["summary"] = summary_rows(report, args)
            report["first_token_agreement"] = first_token_agreement(report, args.num_prompts)
            for phase in report["phases"].values():
                phase.pop("first_tokens", None)
            bench.save()
            print_summary(report, args)


if __name__ == "__main__":
    main()
