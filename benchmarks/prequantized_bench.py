"""Pre-quantized checkpoints of the default model: AWQ, GPTQ and compressed-tensors
versions written by the test helpers (tests/helpers/prequantized_files.py: plain round-to-nearest into each
exact on-disk format) from the default model's fp32 weights, then loaded by tachyllm as any
pre-quantized Hugging Face checkpoint. Per checkpoint: decode tokens/s at batch 1 and 32, the
weights a decode step streams, and `tachy eval quality`'s metrics against the unquantized fp32
model (`tachy eval quality --model Q --reference-model FP32`).

    .venv/bin/python benchmarks/prequantized_bench.py [--threads 2] [--dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from quantization_bench import decode_rate
from safetensors.torch import save_file
from transformers import AutoTokenizer

from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.eval.quality import compare, heldout_windows
from tachyllm.loading import default_model_path, load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.prequantized_files import Scheme, write_prequantized  # noqa: E402

# 576-wide inputs: groups of 64 (128 does not divide them).
SCHEMES = {
    "awq (4-bit asym, g64)": Scheme("awq", group=64),
    "gptq (4-bit sym, g64)": Scheme("gptq", group=64, sym=True),
    "gptq (8-bit sym, g64)": Scheme("gptq", bits=8, group=64, sym=True),
    "compressed-tensors W4A16 (asym, g64)": Scheme("ct_packed", group=64, scale_dtype=torch.bfloat16),
    "compressed-tensors W8A8 (channel)": Scheme("ct_int", bits=8, group=-1, sym=True, scale_dtype=torch.bfloat16),
}


@dataclass
class Row:
    name: str
    weight_mib: float
    decode_b1: float
    decode_b32: float
    ppl: float
    top1: float
    kl_mean: float
    kl_p99: float


def export_fp32(target: Path) -> None:
    """The default model as a plain fp32 Hugging Face checkpoint (tachyllm's dequantized weights,
    the GGUF's tokenizer converted by transformers)."""
    if (target / "config.json").is_file():
        return
    ckpt = load_checkpoint(None)
    c = ckpt.config
    target.mkdir(parents=True, exist_ok=True)
    save_file({name: t.float().contiguous() for name, t in ckpt.weights()}, target / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_ids,
        "torch_dtype": "float32",
    }  # fmt: skip
    (target / "config.json").write_text(json.dumps(config, indent=2))
    path = Path(default_model_path())
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(target)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dir",
        default=str(Path(tempfile.gettempdir()) / "prequantized_bench"),
        help="where the checkpoints are written",
    )
    parser.add_argument("--max-sequences", type=int, default=None, help="score only the first N held-out windows")
    parser.add_argument("--speed-only", action="store_true", help="decode rates only (no quality)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(args.dir)
    fp32 = root / "fp32"
    export_fp32(fp32)

    def engine(path: Path, **kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), threads=args.threads, enable_prefix_caching=False, **kw))

    if not args.speed_only:
        reference = engine(fp32, dtype="float32", max_num_seqs=1, max_model_len=128)
        windows = heldout_windows(reference, 128, args.max_sequences)
    models = {
        "bf16 (the fp32 checkpoint, unquantized)": (fp32, {}),
        "int4 (tachyllm RTN, g64 / 128)": (fp32, {"quantization": "int4"}),
    }
    for name, scheme in SCHEMES.items():
        target = root / name.split(" (")[0].replace(" ", "-") / f"{scheme.method}-{scheme.bits}-{scheme.group}"
        if not (target / "config.json").is_file():
            write_prequantized(fp32, target, None, scheme)
        models[name] = (target, {})
    rows = []
    for name, (path, extra) in models.items():
        eng = engine(path, max_num_seqs=32, max_model_len=256, **extra)
        b1, b32 = decode_rate(eng, 1, 64), decode_rate(eng, 32, 32)
        if args.speed_only:
            print(json.dumps({"name": name, "decode_b1": b1, "decode_b32": b32}), flush=True)
            continue
        report = compare(eng, reference, windows, (name, "fp32"))
        rows.append(Row(name, eng.weight_bytes / 2**20, b1, b32, report.ppl_config, report.top1_agreement,
                        report.kl_mean, report.kl_p99))  # fmt: skip
        print(json.dumps(asdict(rows[-1])), flush=True)
    if args.speed_only:
        return
    print(f"\nfp32 reference perplexity {report.ppl_reference:.3f} on {report.num_sequences} x 128-token windows")
    print("| checkpoint | weights MiB | decode tok/s b=1 | b=32 | perplexity | top-1 vs fp32 | KL mean | KL p99 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.name} | {r.weight_mib:.0f} | {r.decode_b1:.1f} | {r.decode_b32:.1f} | {r.ppl:.2f} | {r.top1:.1%} "
            f"| {r.kl_mean:.4f} | {r.kl_p99:.4f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
