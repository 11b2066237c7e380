"""tachyllm on one CUDA GPU, side by side in one run with Hugging Face transformers (and vLLM when the
machine has it), on random-weight models built on the device.

Models (bf16, random weights, saved with save_pretrained into a temporary directory together with a
synthetic byte-level BPE tokenizer of the full vocabulary; prompts are random token ids):
  - SmolLM2-135M shape (LlamaForCausalLM: hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV
    heads, head_dim 64, vocab 49152, tied embeddings, rope_theta 100000);
  - Llama-3-8B shape (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, head_dim
    128, vocab 128256, rope_theta 500000), when the time budget leaves room for it.

Per model, greedy with EOS ignored (every request generates exactly its token count):
  1. tachyllm single stream, 128 in / 256 out: decode tok/s (1 / mean time per output token after
     the first) and its share of the HBM bandwidth limit (weight bytes read once per token);
     also with --enforce-eager (no CUDA graphs) for the graphs' gain;
  2. tachyllm offline 256 x (128 in / 128 out): output tok/s and achieved TFLOP/s (linear layers,
     LM head and attention FLOPs of the whole run over its wall time);
  3. transformers model.generate on the same weights: the same two workloads;
  4. served: `tachy serve` in a subprocess, `tachy bench serve` sending 256 requests at once
     (128/128): TTFT p99 and output tok/s;
  5. variants, each its own engine under the same --gpu-memory-utilization: fp8 KV cache, int4
     weights, fp8 weights: offline tok/s, single-stream decode tok/s and KV-cache capacity (tokens)
     next to bf16;
  6. vLLM (only if importable): offline batch and single stream.

Each engine is freed before the next loads (every tachyllm engine sizes its KV cache from the
memory left). Each phase catches its own exception and the run continues; a phase predicted to
end past --time-budget seconds is skipped. Writes ONE result file, $OUT/gpu_bench.md (markdown
tables, then the whole report as JSON), rewritten after every phase so that a cut-off run keeps
what it measured; the same is printed at the end.

On the GPU machine, from the repository root (benchmarks/gpu_check.sh runs it after the CUDA tests):

    PYTHONPATH=$PWD python3 benchmarks/gpu_bench.py --time-budget 360

CPU smoke test of the same code path:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gpu_bench.py --device cpu --num-layers 2 --models smollm2-135m \\
        --batch-prompts 4 --serve-prompts 4 --input-len 16 --output-len 8 --single-output-len 8 --warmup-output-len 4
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import logging
import os
import platform
import random
import socket
import string
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

os.environ.setdefault("TACHY_CACHE_DIR", "off")  # nothing written to ~/.cache (HF dirs are not cached anyway)

import torch  # noqa: E402

from tachyllm import LLM, SamplingParams  # noqa: E402
from tachyllm.backends.registry import backend_names  # noqa: E402
from tachyllm.bench.profile import format_profile, profile_decode  # noqa: E402
from tachyllm.kernels.kv_quant import QuantizedKV  # noqa: E402

# The config.json fields that shape the computation. Special ids 0-2 are the synthetic tokenizer's.
COMMON: dict[str, Any] = dict(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu")
MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        COMMON, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        tie_word_embeddings=True, rope_theta=100000.0,
    ),
    "llama3-8b": dict(
        COMMON, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        tie_word_embeddings=False, rope_theta=500000.0,
    ),
}  # fmt: skip
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
FIRST_PROMPT_ID = 100  # random prompt ids skip the special tokens
PAD_ID = 2
# Peak HBM bandwidth (bytes/s) and dense bf16 tensor-core FLOP/s of the GPUs this may run on, by name.
GPU_PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}
# Weight / KV-cache variants next to bf16: (name, EngineConfig overrides).
VARIANTS = [("fp8 KV cache", {"kv_cache_dtype": "fp8"}), ("int4 weights", {"quantization": "int4"}),
            ("fp8 weights", {"quantization": "fp8"}),
            ("2048-token steps", {"max_num_batched_tokens": 2048})]  # fmt: skip


def variant_key(name: str) -> str:
    """A variant's name as --variants matches it: case and dashes for spaces (for shells) do not matter."""
    return name.strip().lower().replace("-", " ")


def chosen_variants(names: str) -> set[str]:
    """--variants as a set of variant keys; a misspelt name is an argument error, not a silent skip."""
    chosen = {variant_key(v) for v in names.split(",") if v.strip()}
    if unknown := chosen - {variant_key(t) for t, _ in VARIANTS}:
        names = [t for t, _ in VARIANTS]
        raise argparse.ArgumentTypeError(f"unknown variant(s) {sorted(unknown)}: choose from {names}")
    return chosen


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--models", default="smollm2-135m,llama3-8b", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--num-layers", type=int, default=None, help="override every model's layer count (smoke tests)")
    ap.add_argument(
        "--backend", default="cuda" if "cuda" in backend_names() else "auto", help="tachyllm's execution backend"
    )
    ap.add_argument("--batch-prompts", type=int, default=256, help="offline batch size (every engine)")
    ap.add_argument("--serve-prompts", type=int, default=256, help="requests sent at once to tachy serve; 0 = skip")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (every workload)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per prompt, batch and served")
    ap.add_argument("--single-output-len", type=int, default=256, help="output tokens of the single stream")
    ap.add_argument("--warmup-prompts", type=int, default=8)
    ap.add_argument("--warmup-output-len", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="every tachyllm engine's share")
    ap.add_argument("--kv-cache-memory-gib", type=float, default=None, help="fixed KV cache (the CPU smoke test)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (default: its own)")
    ap.add_argument("--time-budget", type=float, default=360.0, help="seconds; phases predicted to overrun are skipped")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers phases")
    ap.add_argument("--skip-variants", action="store_true", help="no variants (fp8 / int4, larger steps)")
    ap.add_argument("--variants", type=chosen_variants, default=None,
                    help=f"comma list of variants to run, of {[t for t, _ in VARIANTS]}")  # fmt: skip
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


def build_model(directory: Path, shape: dict[str, Any], device: str, seed: int) -> dict[str, Any]:
    """Saves a random-weight bf16 LlamaForCausalLM of this shape, initialised on the device (an 8B
    model's init on the CPU alone would take minutes); returns its config facts."""
    import transformers

    shape = dict(shape)
    theta = shape.pop("rope_theta")
    config = transformers.LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    build_tokenizer(directory, shape["vocab_size"])
    saved = json.loads((directory / "config.json").read_text())
    params = sum(p.numel() for p in model.parameters())
    del model
    free_memory()
    return {"num_parameters": params, "config_json": saved}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PROMPT_ID, vocab) for _ in range(length)] for _ in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_flops(shape: dict[str, Any], prompts: int, input_len: int, output_len: int) -> float:
    """FLOPs of an offline run: 2 per weight per token in the layers, the LM head once per generated
    token, and attention's QK and PV products over each token's context."""
    h, hd, heads, kv = (
        shape["hidden_size"],
        shape["head_dim"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    layers = shape["num_hidden_layers"]
    per_layer = h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * shape["intermediate_size"]
    tokens = prompts * (input_len + output_len)
    contexts = prompts * (input_len * (input_len + 1) // 2 + sum(input_len + j for j in range(1, output_len + 1)))
    return (
        2.0 * layers * per_layer * tokens
        + 2.0 * h * shape["vocab_size"] * prompts * output_len
        + (4.0 * layers * heads * hd * contexts)
    )


def gpu_peaks() -> tuple[float, float] | tuple[None, None]:
    if not torch.cuda.is_available():
        return None, None
    name = torch.cuda.get_device_name()
    return next((peaks for key, peaks in GPU_PEAKS.items() if key in name), (None, None))


# -- tachyllm -------------------------------------------------------------------------------------


def engine_options(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    options = dict(device=args.device, dtype=args.dtype, backend=args.backend, max_num_seqs=args.max_num_seqs,
                   seed=args.seed)  # fmt: skip
    if args.max_num_batched_tokens is not None:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory_gib is not None:
        options["kv_cache_memory"] = int(args.kv_cache_memory_gib * 2**30)
    elif args.device.startswith("cuda"):
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    return {**options, **overrides}


def make_llm(path: Path, args: argparse.Namespace, **overrides: Any) -> LLM:
    return LLM(str(path), **engine_options(args, **overrides))


def engine_settings(llm: LLM) -> dict[str, Any]:
    """The EngineConfig the LLM runs with, plus what it derived from it (cache blocks, graphs)."""
    engine = llm.engine
    config = {f.name: getattr(engine.config, f.name) for f in fields(engine.config)}
    config = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in config.items()}
    bm = engine.block_manager
    graphs = engine.runner.graphs
    cache = engine.runner.kv_caches[0][0]
    return {
        "config": config,
        "backend": engine.backend.name,
        "kv_cache_tokens": bm.num_blocks * bm.block_size,
        "kv_cache_dtype": str((cache.paged() if isinstance(cache, QuantizedKV) else cache).dtype),
        "weight_bytes": engine.weight_bytes,
        "cuda_graphs": None if graphs is None else len(graphs.graphs),
    }


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def batch_figures(prompts: list[list[int]], new: int, tokens: int, seconds: float) -> dict[str, Any]:
    return {
        "prompts": len(prompts),
        "generated_tokens": tokens,
        "expected_tokens": len(prompts) * new,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
    }


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
    return batch_figures(prompts, new, tokens, seconds)


def tachy_single(llm: LLM, prompt: list[int], new: int, device: str) -> dict[str, Any]:
    sync(device)
    start = time.perf_counter()
    out = llm.generate([prompt], greedy(new), use_tqdm=False)[0]
    sync(device)
    seconds = time.perf_counter() - start
    if out.error:
        raise RuntimeError(out.error)
    tpot = out.metrics.mean_tpot
    return {"seconds": seconds, "ttft_s": out.metrics.ttft, "decode_tok_s": 1.0 / tpot if tpot else None}


def tachy_profile(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """The decode-step profile (host time by stage, device kernels and their time per step), as text too."""
    profiled = profile_decode(llm.engine, prompts, num_steps=steps, warmup_steps=5)
    return dict(asdict(profiled), text=format_profile(profiled))


def served(path: Path, args: argparse.Namespace, prompts: int, seed: int) -> dict[str, Any]:
    """`tachy bench serve` metrics of `prompts` x input/output all at once against `tachy serve`."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tachy = [sys.executable, "-m", "tachyllm.entrypoints.cli"]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_options(args).items()]
    server = subprocess.Popen([*tachy, "serve", str(path), "--port", str(port), *flags], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("tachy serve did not come up")
            time.sleep(0.5)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            subprocess.run(
                [*tachy, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(path),
                 "--num-prompts", str(prompts), "--input-len", str(args.input_len), "--output-len",
                 str(args.output_len), "--ignore-eos", "--seed", str(seed), "--warmup", "8", "--no-progress",
                 "--result-json", str(out)],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            metrics = json.loads(out.read_text())["runs"][0]["metrics"]
        return {
            "completed": metrics.get("completed"),
            "output_tok_s": metrics.get("output_throughput"),
            "ttft_p99_ms": (metrics.get("ttft_ms") or {}).get("p99"),
            "ttft_median_ms": (metrics.get("ttft_ms") or {}).get("median"),
            "tpot_median_ms": (metrics.get("tpot_ms") or {}).get("median"),
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


# -- transformers and vLLM ------------------------------------------------------------------------


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
    return batch_figures(prompts, new, out.numel(), seconds)


def hf_single(model, prompt: list[int], new: int, device: str) -> dict[str, Any]:
    # Decode rate from the difference of two generates, so that prefill does not count.
    prefill, _ = hf_generate(model, [prompt], 1, device)
    longer, _ = hf_generate(model, [prompt], new + 1, device)
    return {"seconds": longer, "ttft_s": prefill, "decode_tok_s": new / (longer - prefill)}


def vllm_phases(path: Path, args: argparse.Namespace, p: dict[str, Any]) -> dict[str, Any]:
    """vLLM's offline batch and single stream on the same weights (its defaults: CUDA graphs on)."""
    import vllm
    from vllm.inputs import TokensPrompt

    llm = vllm.LLM(str(path), dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
                   max_num_seqs=args.max_num_seqs)  # fmt: skip

    def generate(prompts: list[list[int]], new: int) -> float:
        params = vllm.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    generate(p["warm"], args.warmup_output_len)
    batch_seconds = generate(p["batch"], args.output_len)
    prefill = generate([p["single"]], 1)
    longer = generate([p["single"]], args.single_output_len + 1)
    result = {
        "version": vllm.__version__,
        "batch": batch_figures(p["batch"], args.output_len, len(p["batch"]) * args.output_len, batch_seconds),
        "single": {"decode_tok_s": args.single_output_len / (longer - prefill), "ttft_s": prefill},
    }
    llm = None  # freed: the closure holds the name
    free_memory()
    return result


# -- the run --------------------------------------------------------------------------------------


class Bench:
    """Runs phases in order, each in its own try/except, recording results and timings as it goes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.perf_counter()
        self.report: dict[str, Any] = {"args": vars(args), "env": environment(args.device), "phases": {}, "errors": {}}
        self.out_file = Path(os.environ["OUT"]) / "gpu_bench.md" if os.environ.get("OUT") else None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.args.time_budget - self.elapsed()

    def phase(self, name: str, fn: Callable[[], Any], estimate: float = 0.0) -> Any:
        """Runs fn; records its result (a dict) and seconds. Skipped when `estimate` seconds would
        overrun the time budget."""
        if estimate > self.left():
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
        recorded = dict(result) if isinstance(result, dict) else {}
        self.report["phases"][name] = dict(recorded, phase_seconds=seconds)
        shown = {
            k: round(v, 2) if isinstance(v, float) else v
            for k, v in recorded.items()
            if k not in ("config", "text", "top_ops", "top_device_ops")
        }
        log(f"[{self.elapsed():6.1f}s] {name}: {seconds:.1f} s {json.dumps(shown, default=str)}")
        self.save()
        return result

    def get(self, name: str, key: str) -> Any:
        return (self.report["phases"].get(name) or {}).get(key)

    def save(self) -> None:
        self.report["elapsed_s"] = self.elapsed()
        if self.out_file is not None:
            self.out_file.parent.mkdir(parents=True, exist_ok=True)
            self.out_file.write_text(render(self.report, self.args))


def environment(device: str) -> dict[str, Any]:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm_importable": importlib.util.find_spec("vllm") is not None,
        "triton_importable": importlib.util.find_spec("triton") is not None,
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


def make_prompts(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Random token-id prompts, a fresh set per workload: tachyllm caches prompt prefixes across runs."""
    length, seed = args.input_len, args.seed
    return {
        "batch": random_prompts(args.batch_prompts, length, vocab, seed + 1),
        "single": random_prompts(1, length, vocab, seed + 2)[0],
        "single_eager": random_prompts(1, length, vocab, seed + 3)[0],
        "warm": random_prompts(args.warmup_prompts, length, vocab, seed + 4),
        "variant_batches": [
            random_prompts(args.batch_prompts, length, vocab, seed + 10 + i) for i in range(len(VARIANTS))
        ],
    }


def run_model(bench: Bench, model: str, directory: Path) -> None:
    """Every workload of one model shape: tachyllm, transformers, served, variants, vLLM; each engine
    freed before the next loads."""
    args = bench.args
    shape = dict(MODELS[model])
    if args.num_layers is not None:
        shape["num_hidden_layers"] = args.num_layers
    if bench.phase(f"{model}/build", lambda: build_model(directory, shape, args.device, args.seed)) is None:
        return
    bench.report.setdefault("shapes", {})[model] = shape
    p = make_prompts(args, shape["vocab_size"])
    n, new, single_new = args.batch_prompts, args.output_len, args.single_output_len
    bench.report.setdefault("flops", {})[model] = run_flops(shape, n, args.input_len, new)
    per_single = single_new / (new * max(1, n // 8))  # a single stream's step is at most a batch step

    def tachyllm_engine(tag: str, prompts_batch: list[list[int]], **overrides: Any) -> None:
        """Load, warm up, single stream, offline batch; the engine freed after."""
        loaded: dict[str, LLM] = {}

        def load() -> dict[str, Any]:
            loaded["llm"] = make_llm(directory, args, **overrides)
            return engine_settings(loaded["llm"])

        bench.phase(f"{model}/{tag}/load", load)
        llm = loaded.pop("llm", None)
        if llm is None:
            return
        bench.phase(f"{model}/{tag}/warmup", lambda: tachy_batch(llm, p["warm"], args.warmup_output_len, args.device))
        bench.phase(f"{model}/{tag}/single", lambda: tachy_single(llm, p["single"], single_new, args.device))
        if tag == "bf16":
            bench.phase(f"{model}/{tag}/profile1", lambda: tachy_profile(llm, [p["single"]], 20))
        estimate = (bench.get(f"{model}/{tag}/single", "seconds") or 0.0) / per_single
        bench.phase(f"{model}/{tag}/batch", lambda: tachy_batch(llm, prompts_batch, new, args.device), estimate)
        if tag == "bf16":
            bench.phase(f"{model}/{tag}/profile64", lambda: tachy_profile(llm, p["warm"] * 8, 10))
            bench.phase(f"{model}/{tag}/profile256", lambda: tachy_profile(llm, prompts_batch, 10))
        if tag == "bf16" and args.device.startswith("cuda"):
            llm = None
            free_memory()
            llm = bench.phase(f"{model}/eager/load", lambda: make_llm(directory, args, enforce_eager=True))
            if llm is not None:
                bench.phase(f"{model}/eager/single", lambda: tachy_single(llm, p["single_eager"], single_new,
                                                                          args.device))  # fmt: skip
                bench.phase(f"{model}/eager/profile1", lambda: tachy_profile(llm, [p["single_eager"]], 20))
        llm = None
        free_memory()

    tachyllm_engine("bf16", p["batch"])
    if not args.skip_hf:
        hf = bench.phase(f"{model}/hf/load", lambda: load_hf(directory, args))
        if hf is not None:
            bench.phase(f"{model}/hf/warmup", lambda: hf_batch(hf, p["warm"], args.warmup_output_len, args.device))
            bench.phase(f"{model}/hf/single", lambda: hf_single(hf, p["single"], single_new, args.device))
            estimate = (bench.get(f"{model}/hf/single", "seconds") or 0.0) / per_single
            bench.phase(f"{model}/hf/batch", lambda: hf_batch(hf, p["batch"], new, args.device), estimate)
            hf = None
            free_memory()
    if args.serve_prompts:
        estimate = 30.0 + (bench.get(f"{model}/bf16/batch", "seconds") or 0.0) * args.serve_prompts / n
        bench.phase(f"{model}/served", lambda: served(directory, args, args.serve_prompts, args.seed + 7), estimate)
    if not args.skip_variants:
        for i, (tag, overrides) in enumerate(VARIANTS):
            if args.variants is not None and variant_key(tag) not in args.variants:
                continue
            estimate = 20.0 + (bench.get(f"{model}/bf16/batch", "seconds") or 0.0)
            if estimate > bench.left():
                bench.report["phases"][f"{model}/{tag}/load"] = {"skipped": f"estimated {estimate:.1f} s"}
                continue
            tachyllm_engine(tag, p["variant_batches"][i], **overrides)
    if bench.report["env"]["vllm_importable"] and args.device.startswith("cuda"):
        bench.phase(f"{model}/vllm", lambda: vllm_phases(directory, args, p), 60.0)


def run(bench: Bench) -> None:
    models = [m.strip() for m in bench.args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model shape(s) {unknown}: choose from {', '.join(MODELS)}")
    for model in models:
        # An 8B model's build, save and first load are the slowest phases: start it only with room for them.
        if model == "llama3-8b" and bench.left() < 60:
            bench.report["phases"][f"{model}/build"] = {"skipped": f"{bench.left():.0f} s left of the budget"}
            continue
        with tempfile.TemporaryDirectory(prefix=f"tachy-gpu-bench-{model}-") as tmp:
            try:
                run_model(bench, model, Path(tmp))
            except Exception as e:  # outside a phase: the next model still runs
                traceback.print_exc(file=sys.stdout)
                bench.report["errors"][model] = f"{type(e).__name__}: {e}"
        free_memory()


# -- the report -----------------------------------------------------------------------------------


def summary_rows(report: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per model and workload: tachyllm, transformers, vLLM and tachyllm / transformers."""
    phases, rows = report["phases"], []
    bandwidth, flops_peak = gpu_peaks()

    def value(name: str, key: str) -> Any:
        return (phases.get(name) or {}).get(key)

    for model in report.get("shapes", {}):
        vllm = phases.get(f"{model}/vllm") or {}
        single = f"single stream {args.input_len} in / {args.single_output_len} out, decode tok/s"
        batch = f"offline {args.batch_prompts} x ({args.input_len} / {args.output_len}), output tok/s"
        for workload, ours, theirs, key, v in (
            (single, f"{model}/bf16/single", f"{model}/hf/single", "decode_tok_s", (vllm.get("single") or {})),
            (batch, f"{model}/bf16/batch", f"{model}/hf/batch", "output_tok_s", (vllm.get("batch") or {})),
        ):
            a, b = value(ours, key), value(theirs, key)
            rows.append({"model": model, "workload": workload, "tachyllm": a, "transformers": b,
                         "vllm": v.get(key), "ratio": a / b if a and b else None})  # fmt: skip
        eager = value(f"{model}/eager/single", "decode_tok_s")
        rows.append({"model": model, "workload": single.replace("decode", "--enforce-eager decode"),
                     "tachyllm": eager, "transformers": None, "vllm": None, "ratio": None})  # fmt: skip
        weight_bytes = value(f"{model}/bf16/load", "weight_bytes")
        tok_s = value(f"{model}/bf16/single", "decode_tok_s")
        if bandwidth and weight_bytes and tok_s:
            rows.append({"model": model, "workload": "single stream: share of the HBM bandwidth limit",
                         "tachyllm": tok_s * weight_bytes / bandwidth, "transformers": None, "vllm": None,
                         "ratio": None, "limit_tok_s": bandwidth / weight_bytes})  # fmt: skip
        seconds = value(f"{model}/bf16/batch", "seconds")
        if seconds:
            tflops = report["flops"][model] / seconds / 1e12
            rows.append({"model": model, "workload": "offline batch: achieved TFLOP/s", "tachyllm": tflops,
                         "transformers": None, "vllm": None,
                         "ratio": tflops * 1e12 / flops_peak if flops_peak else None})  # fmt: skip
        serve = phases.get(f"{model}/served") or {}
        for key, label in (("output_tok_s", "output tok/s"), ("ttft_p99_ms", "TTFT p99 ms")):
            rows.append({"model": model, "workload": f"served {args.serve_prompts} at once, {label}",
                         "tachyllm": serve.get(key), "transformers": None, "vllm": None, "ratio": None})  # fmt: skip
    return rows


def variant_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    phases, rows = report["phases"], []
    for model in report.get("shapes", {}):
        for tag in ["bf16"] + [t for t, _ in VARIANTS]:
            load = phases.get(f"{model}/{tag}/load") or {}
            rows.append({
                "model": model, "variant": tag, "kv_cache_tokens": load.get("kv_cache_tokens"),
                "weight_bytes": load.get("weight_bytes"),
                "batch_output_tok_s": (phases.get(f"{model}/{tag}/batch") or {}).get("output_tok_s"),
                "single_decode_tok_s": (phases.get(f"{model}/{tag}/single") or {}).get("decode_tok_s"),
            })  # fmt: skip
    return rows


def render(report: dict[str, Any], args: argparse.Namespace) -> str:
    """The result file: markdown tables, then the whole report as JSON."""

    def fmt(x: Any) -> str:
        if x is None:
            return "n/a"
        return f"{x:.3g}" if isinstance(x, float) and abs(x) < 10 else f"{x:,.0f}" if isinstance(x, (int, float)) else x

    env = report["env"]
    vllm = " and vLLM" if env.get("vllm_importable") else ""
    lines = [
        f"## tachyllm vs transformers{vllm}: {env.get('gpu', args.device)}, torch {env['torch']}, "
        f"transformers {env['transformers']}, {args.dtype}, random weights, backend {args.backend}",
        "",
        "| model | workload | tachyllm | transformers | vLLM | tachyllm / transformers (TFLOP/s: share of peak) |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary_rows(report, args):
        lines.append(f"| {row['model']} | {row['workload']} | {fmt(row['tachyllm'])} | {fmt(row['transformers'])} | "
                     f"{fmt(row['vllm'])} | {fmt(row['ratio'])} |")  # fmt: skip
    lines += ["", "| model | weights / KV | KV cache tokens | weight bytes | offline output tok/s | single decode tok/s"
              " |", "|---|---|---|---|---|---|"]  # fmt: skip
    for row in variant_rows(report):
        lines.append(f"| {row['model']} | {row['variant']} | {fmt(row['kv_cache_tokens'])} | {fmt(row['weight_bytes'])}"
                     f" | {fmt(row['batch_output_tok_s'])} | {fmt(row['single_decode_tok_s'])} |")  # fmt: skip
    profiles = [(name, phase["text"]) for name, phase in report["phases"].items() if "text" in phase]
    for name, text in profiles:
        lines += ["", f"{name}:", "```", text, "```"]
    if report["errors"]:
        lines += ["", "Errors:", *(f"- {k}: {v}" for k, v in report["errors"].items())]
    lines += ["", f"total {report.get('elapsed_s', 0):.1f} s", "", "```json", json.dumps(report, indent=1, default=str),
              "```", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tachyllm").setLevel(logging.INFO)
    bench = Bench(args)
    log(f"environment: {json.dumps(bench.report['env'])}")
    try:
        run(bench)
    finally:
        bench.save()
        log("")
        log(render(bench.report, args))


if __name__ == "__main__":
    main()
