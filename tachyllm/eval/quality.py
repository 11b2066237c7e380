"""`tachy eval quality`: how far a configuration (quantized weights, KV cache, dtype) moves the
model's predictions from an unquantized reference, on the held-out text shipped in tachyllm/data.

Both engines score the same windows teacher-forced (each window one step of the engine's own model
runner, so its backend, its KV cache and the cache's quantization all count). Reported:
perplexity of each, top-1 next-token agreement, and the distribution of per-sequence mean
KL(reference || configuration) with the worst sequences — averages hide the tails that users hit.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace

import torch

from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import add_engine_args, engine_config
from tachyllm.errors import ConfigError
from tachyllm.quantization.activation_bits import model_activation_bits
from tachyllm.quantization.calibration import HELDOUT_FILE, load_text, next_token_kl, sequence_batch, token_windows
from tachyllm.runner.model_runner import ModelRunner

DEFAULT_SEQ_LEN = 128


@dataclass
class SequenceScore:
    index: int
    kl: float  # mean KL(reference || config) per predicted token, nats
    top1_agreement: float
    preview: str  # the start of the window's text


@dataclass
class QualityReport:
    config: str
    reference: str
    num_sequences: int
    num_tokens: int  # predicted tokens per model
    ppl_reference: float
    ppl_config: float
    top1_agreement: float
    kl_mean: float
    kl_p50: float
    kl_p99: float
    kl_max: float
    worst: list[SequenceScore] = field(default_factory=list)


def describe(engine: LLMEngine) -> str:
    """The configuration as `engine` resolved it: a pre-quantized checkpoint's own quantization, 8-bit
    activations however they were chosen (given, or gguf's load-time check)."""
    config = engine.config
    dtype = "bfloat16" if config.dtype == "auto" else config.dtype
    bits = " (activations 8-bit)" if model_activation_bits(engine.model) == 8 else ""
    weights = engine.quantization or "unquantized"
    return f"{dtype}, weights {weights}{bits}, kv {config.kv_cache_dtype}"


def eval_engine(config: EngineConfig, seq_len: int) -> LLMEngine:
    """An engine whose cache holds exactly one window (the eval never schedules requests). It scores
    windows through rank 0's runner alone (ModelRunner.forward): a tensor-parallel engine cannot."""
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            f"tachy eval runs in one process: tensor_parallel_size must be 1, got {config.tensor_parallel_size}"
        )
    return LLMEngine(
        replace(
            config, max_num_seqs=1, max_model_len=max(seq_len, 2), kv_cache_memory=None, enable_prefix_caching=False
        )
    )


def sequence_logprobs(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities [n, vocab] (fp32) of the next token at every position of the window."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "eval_engine refuses tensor parallelism"
    hidden = runner.forward(sequence_batch(token_ids, engine.config.block_size))
    with torch.inference_mode():
        return torch.log_softmax(engine.model.compute_logits(hidden).float(), dim=-1)


def _percentile(values: list[float], q: float) -> float:
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


def compare(
    engine: LLMEngine, reference: LLMEngine, windows: list[list[int]], labels: tuple[str, str], worst: int = 3
) -> QualityReport:
    scores, nll_ref, nll_cfg, agree, tokens = [], 0.0, 0.0, 0, 0
    for i, ids in enumerate(windows):
        lp_ref = sequence_logprobs(reference, ids)[:-1]
        lp_cfg = sequence_logprobs(engine, ids)[:-1]
        target = torch.tensor(ids[1:]).unsqueeze(1)
        nll_ref -= float(lp_ref.gather(1, target).sum())
        nll_cfg -= float(lp_cfg.gather(1, target).sum())
        kl = next_token_kl(lp_ref, lp_cfg)
        same = int((lp_ref.argmax(-1) == lp_cfg.argmax(-1)).sum())
        agree, tokens = agree + same, tokens + len(ids) - 1
        preview = reference.tokenizer.decode(ids[:24]).replace("\n", " ")
        scores.append(SequenceScore(i, float(kl.mean()), same / (len(ids) - 1), preview))
    kls = [s.kl for s in scores]
    return QualityReport(
        config=labels[0],
        reference=labels[1],
        num_sequences=len(windows),
        num_tokens=tokens,
        ppl_reference=math.exp(nll_ref / tokens),
        ppl_config=math.exp(nll_cfg / tokens),
        top1_agreement=agree / tokens,
        kl_mean=sum(kls) / len(kls),
        kl_p50=_percentile(kls, 0.5),
        kl_p99=_percentile(kls, 0.99),
        kl_max=max(kls),
        worst=sorted(scores, key=lambda s: -s.kl)[:worst],
    )


def heldout_windows(engine: LLMEngine, seq_len: int, max_sequences: int | None = None) -> list[list[int]]:
    return token_windows(engine.tokenizer, load_text(HELDOUT_FILE), seq_len, max_sequences)


def format_report(r: QualityReport) -> str:
    lines = [
        f"quality: {r.config}  vs  reference: {r.reference}",
        f"held-out set: {r.num_sequences} sequences, {r.num_tokens} predicted tokens",
        f"{'':24}{'reference':>12}{'config':>12}",
        f"{'perplexity':24}{r.ppl_reference:>12.3f}{r.ppl_config:>12.3f}",
        f"{'top-1 agreement':24}{'':>12}{r.top1_agreement:>12.2%}",
        f"{'KL per sequence (nats)':24}mean {r.kl_mean:.4f}  p50 {r.kl_p50:.4f}  "
        f"p99 {r.kl_p99:.4f}  max {r.kl_max:.4f}",
        "worst sequences:",
    ]
    lines += [f"  #{s.index:<3} KL {s.kl:.4f}  top-1 {s.top1_agreement:.0%}  {s.preview!r}" for s in r.worst]
    return "\n".join(lines)


def cmd_quality(args: argparse.Namespace) -> int:
    config = engine_config(args)
    ref_config = replace(
        config, model=args.reference_model or config.model, dtype=args.reference_dtype, quantization=None,
        quant_group_size=None, quant_skip=None, quant_activation_bits=None, kv_cache_dtype="auto",
    )  # fmt: skip
    reference = eval_engine(ref_config, args.seq_len)
    engine = eval_engine(config, args.seq_len)
    windows = heldout_windows(engine, args.seq_len, args.max_sequences)
    labels = (describe(engine), describe(reference))
    if args.reference_model:
        labels = (labels[0], f"{labels[1]}, model {args.reference_model}")
    report = compare(engine, reference, windows, labels, args.worst)
    print(json.dumps(asdict(report), indent=2) if args.json else format_report(report))
    return 0


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="evaluation tools")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    q = ev_sub.add_parser(
        "quality", help="compare a (quantized) configuration with the unquantized reference on held-out text"
    )
    add_engine_args(q)
    q.add_argument(
        "--reference-dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the unquantized reference",
    )
    q.add_argument(
        "--reference-model",
        default=None,
        help="the reference's model (default: --model); a pre-quantized checkpoint's unquantized original",
    )
    q.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per held-out sequence")
    q.add_argument("--max-sequences", type=int, default=None, help="score only the first N sequences")
    q.add_argument("--worst", type=int, default=3, help="how many of the worst sequences to print")
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.set_defaults(func=cmd_quality)
