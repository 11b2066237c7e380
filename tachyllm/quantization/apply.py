"""quantize_model: swaps the selected nn.Linear modules of a loaded model for quantized ones
(gpt-fast style, after load_weights) and logs what changed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from tachyllm.errors import ConfigError, ModelLoadError
from tachyllm.loading.hf_quantized import PrequantizedWeights
from tachyllm.model_config import ModelConfig
from tachyllm.quantization.awq import awq_linear, collect_inputs
from tachyllm.quantization.calibration import calibration_windows
from tachyllm.quantization.fp8 import ALIGN, Fp8Linear, fp8_unavailable_reason
from tachyllm.quantization.gguf_packed import (
    ATEN_TYPES,
    TABLE,
    GGUFBlocks,
    GGUFEmbedding,
    GGUFLinear,
    head_weight_name,
    int4_weight,
    kernel_types,
)
from tachyllm.quantization.int4 import GROUP_SIZES, Int4Linear, Int4Weight
from tachyllm.quantization.int8 import Int8Linear, row_amax
from tachyllm.quantization.model_parts import model_config, submodule
from tachyllm.quantization.policy import select_linears
from tachyllm.quantization.prequantized import build, read_parts

logger = logging.getLogger("tachyllm")

AWQ_WINDOWS, AWQ_SEQ_LEN = 8, 256  # ≈2k calibration tokens
# Methods that name a pre-quantized checkpoint's format (quantization_config.quant_method, vLLM's names).
PREQUANTIZED_METHODS = ("awq", "gptq", "compressed-tensors")

# Fused modules and the checkpoint weights stacked into them (gguf-native needs every part packed).
_FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class TensorShard(Protocol):
    """A tensor-parallel rank's share of the checkpoint (distributed.sharding.ShardPlan): the model it
    loaded is the shard's, and its quantized layers must hold exactly the whole model's groups and
    blocks for those rows and columns."""

    @property
    def full(self) -> ModelConfig: ...

    @property
    def size(self) -> int: ...

    @property
    def vocab_per_rank(self) -> int: ...

    def index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None: ...

    def full_in_features(self, name: str) -> int: ...

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class QuantizationResult:
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # module -> why it stayed unquantized
    bytes_before: int = 0  # weight bytes of the quantized modules before / after
    bytes_after: int = 0
    head: str | None = None  # gguf: what the LM head runs on, when the file decides it
    embedding: str | None = None  # gguf: what the embedding lookup reads, when not a dequantized table


def module_bytes(module: nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    if isinstance(module, Int4Linear) and module.input_scale is not None:
        tensors.append(module.input_scale)
    bias = getattr(module, "bias", None)  # a packed layer may keep its bias outside its parameters
    if isinstance(bias, torch.Tensor) and not isinstance(module, nn.Linear):
        tensors.append(bias)
    return sum(t.numel() * t.element_size() for t in tensors)


def group_size_for(name: str, in_features: int, requested: int | None) -> int | None:
    """The requested group size (error if it does not divide the layer) or, unset, the largest
    supported one that does (576-wide layers of SmolLM2 get 64); None when no size fits."""
    if requested is not None:
        if in_features % requested:
            raise ConfigError(
                f"quant_group_size={requested} does not divide layer {name} (in_features={in_features}); "
                f"accepted: one of {', '.join(map(str, GROUP_SIZES))} dividing every quantized layer, or unset"
            )
        return requested
    return next((g for g in reversed(GROUP_SIZES) if in_features % g == 0), None)


def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int | None,
    skip: tuple[str, ...],
    tokenizer=None,
    gguf_blocks: dict[str, GGUFBlocks] | None = None,
    kernels: ModuleType | None = None,
    prequantized: PrequantizedWeights | None = None,
    matmul: ModuleType | None = None,
    shard: TensorShard | None = None,
) -> QuantizationResult:
    """`gguf_blocks`: for gguf, the model file's matrices as stored (gguf_packed.gguf_matrices).
    `kernels`: the backend's block kernels (Backend.block_kernels) that int4 / GGUF block layers pack
    their weights for, or None (aten's int4 layout on the CPU, dequantized matmuls elsewhere).
    `prequantized`: a pre-quantized checkpoint's packed linears, run as stored (`method` is its format).
    `matmul`: the backend's quantized matmul kernels (Backend.quantized_matmul_kernels) that int4 and
    int8 layers run on when it has them (every int4 source: int4, awq, Q4_0 / Q4_1 of gguf, 4-bit
    pre-quantized checkpoints). `shard`: the tensor-parallel rank `model` is the share of (int4,
    int8, gguf; docs/tensor_parallel.md): its layers get the whole model's groups, scales and blocks,
    and a split that would cut an int4 group or a GGUF block is refused."""
    targets, skipped = select_linears(model, skip)
    result = QuantizationResult(kept={n: "skipped by quant_skip" for n in skipped})
    groups: dict[str, int] = {}
    if prequantized is not None:
        if method != prequantized.format.method:
            raise ConfigError(
                f"quantization={method!r} does not match the checkpoint's quantization_config.quant_method = "
                f"{prequantized.format.method}; leave quantization unset or pass {prequantized.format.method}"
            )
        method = f"{method} (pre-quantized, {prequantized.format.layout})"
    elif method in ("gptq", "compressed-tensors"):
        raise ConfigError(
            f"quantization={method!r} needs a pre-quantized checkpoint (a Hugging Face directory whose config.json "
            f"has quantization_config.quant_method = {method}); accepted for other models: int8, int4, awq, gguf"
        )
    if method == "fp8":
        reason = fp8_unavailable_reason(next(model.parameters()).device)
        if reason is not None:
            raise ConfigError(f"quantization='fp8' cannot run here: {reason}; accepted here: int8, int4, awq")
        for name in list(targets):
            m = submodule(model, name, nn.Linear)
            if m.in_features % ALIGN or m.out_features % ALIGN:
                result.kept[name] = f"in/out features not multiples of {ALIGN} (fp8 GEMM)"
        targets = [n for n in targets if n not in result.kept]
    if method in ("int4", "awq"):
        for name in targets:
            in_features = submodule(model, name, nn.Linear).in_features
            if shard is not None:  # the whole layer's group size, the same on every rank as at TP=1
                key = _part_keys(name)[0]
                in_features = shard.full_in_features(key)
            g = group_size_for(name, in_features, group_size)
            if g is None:
                result.kept[name] = f"in_features={in_features} is not a multiple of 32"
            else:
                if shard is not None:
                    _shard_columns(shard, key, g, f"{method} groups", "a smaller quant_group_size")
                groups[name] = g
        targets = [n for n in targets if n in groups]

    replacements: dict[str, nn.Module]
    if prequantized is not None:
        replacements = _prequantized(model, targets, prequantized, result, kernels, matmul)
    elif method == "int8":
        replacements = {n: _int8(submodule(model, n, nn.Linear), n, matmul, shard) for n in targets}
    elif method == "int4":
        replacements = {
            n: Int4Linear.from_linear(submodule(model, n, nn.Linear), groups[n], kernels, matmul) for n in targets
        }
    elif method == "awq":
        replacements = _awq(model, targets, groups, tokenizer, kernels, matmul)
    elif method == "gguf":
        replacements = _gguf(model, targets, gguf_blocks, result, kernels, matmul, shard)
    elif method == "fp8":
        replacements = {n: Fp8Linear.from_linear(submodule(model, n, nn.Linear)) for n in targets}
    else:
        raise ConfigError(f"unknown quantization {method!r}")

    for name, new in replacements.items():
        old = submodule(model, name, nn.Linear)
        result.bytes_before += old.weight.numel() * old.weight.element_size()
        result.bytes_after += module_bytes(new)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        result.quantized.append(name)
    _log(method, result, groups)
    return result


def _int8(linear: nn.Linear, name: str, matmul: ModuleType | None, shard: TensorShard | None) -> Int8Linear:
    """A rank's part of a row-parallel layer (o, down: all rows, some columns) takes the whole rows'
    scales (their maxima over the ranks; every rank quantizes the same layers in the same order)."""
    if shard is None:
        return Int8Linear.from_linear(linear, matmul)
    start, stop, full = _input_columns(shard, _part_keys(name)[0])
    if (start, stop) == (0, full):
        return Int8Linear.from_linear(linear, matmul)
    return Int8Linear.from_linear(linear, matmul, shard.max_over_ranks(row_amax(linear.weight.detach())))


def _awq(
    model: nn.Module,
    targets: list[str],
    groups: dict[str, int],
    tokenizer,
    kernels: ModuleType | None,
    matmul: ModuleType | None,
) -> dict[str, nn.Module]:
    windows = calibration_windows(model, tokenizer, AWQ_SEQ_LEN, AWQ_WINDOWS)
    if not windows:
        raise ConfigError("awq: the calibration text is shorter than one window")
    inputs = collect_inputs(model, targets, windows)
    out: dict[str, nn.Module] = {}
    plain_total, best_total = 0.0, 0.0
    for name in targets:
        out[name], plain, best = awq_linear(
            submodule(model, name, nn.Linear), inputs.pop(name), groups[name], kernels, matmul
        )
        plain_total, best_total = plain_total + plain, best_total + best
    logger.info(
        "awq: %d calibration tokens; summed layer output MSE %.4g (plain int4) -> %.4g (awq)",
        sum(map(len, windows)), plain_total, best_total,
    )  # fmt: skip
    return out


def _gguf(
    model: nn.Module,
    targets: list[str],
    matrices: dict[str, GGUFBlocks] | None,
    result: QuantizationResult,
    kernels: ModuleType | None,
    matmul: ModuleType | None,
    shard: TensorShard | None,
) -> dict[str, nn.Module]:
    """Runs the targeted layers on the file's own blocks: every type the C++ block kernels take
    (GGUFLinear), or, without those kernels, Q4_0/Q4_1 as Int4Linear (on the backend's quantized
    matmul kernels where it has them, else aten's int4 kernel on the CPU). The LM
    head (its own output.weight or the tied token_embd) runs on its blocks whenever the kernels take
    its type. A layer with a part of another type stays dequantized: one log line names them. The
    embedding lookup reads the table's blocks too (GGUFEmbedding) where the kernels take its type,
    sharing a tied head's tiles; a tensor-parallel rank keeps its dequantized vocabulary shard.

    quant_skip under gguf names layers to dequantize to the model dtype instead, except the LM head.
    The default skip exists so that tachyllm does not round the head more coarsely than the
    checkpoint; a GGUF head's blocks *are* the checkpoint's precision, and a dequantized bf16 copy
    would only round it once more and stream more bytes (the default model's Q8_0 head: 54 vs 29 MiB
    per step; a Q4_K_M file's Q6_K head: 2.4x). Without the block kernels the head is dequantized,
    except that a Q4_0/Q4_1 head keeps the usual rule (skipped by default, else aten's int4 kernel).
    """
    if matrices is None:
        raise ConfigError("quantization='gguf' needs a GGUF model file; accepted for other models: int8, int4, awq")
    packable = kernel_types(kernels) if kernels is not None else ATEN_TYPES
    config = model_config(model)
    dtype = submodule(model, "embed_tokens", nn.Embedding).weight.dtype
    head_source = head_weight_name(config)
    head, table = matrices.get(head_source), matrices.get(TABLE)
    kept_rows = getattr(model, "head_token_ids", None)
    if head is not None and kept_rows is not None:
        # A draft's vocabulary shortlist (keep_head_rows): its head is those rows of the file's blocks.
        head = matrices[head_source] = head.part(kept_rows.cpu(), slice(None))
    if _packs_head(head, packable, kernels):
        assert head is not None and kernels is not None, "_packs_head checked both"
        model.lm_head = GGUFLinear([rank_blocks(head, shard)], kernels)
        result.kept.pop("lm_head", None)
        targets = [n for n in targets if n != "lm_head"]
        result.head = f"the file's {head.qtype.name} blocks ({head_source}), C++ kernel"
    if _packs_embedding(table, packable, kernels, shard):
        assert table is not None and kernels is not None, "_packs_embedding checked both"
        if table.raw.shape[0] != config.vocab_size:  # the check a dense table gets from load_weights
            raise ModelLoadError(
                f"checkpoint tensor {TABLE!r} has {table.raw.shape[0]} rows, expected the vocabulary's "
                f"{config.vocab_size}"
            )
        lm_head = model.lm_head
        if config.tie_word_embeddings and kept_rows is None and isinstance(lm_head, GGUFLinear):
            model.embed_tokens = GGUFEmbedding.sharing(lm_head, dtype, kernels)
            result.embedding = f"the file's {table.qtype.name} blocks, the tied LM head's tiles (one copy)"
        else:
            model.embed_tokens = GGUFEmbedding.from_blocks(table, dtype, kernels)
            result.embedding = f"the file's {table.qtype.name} blocks, rows dequantized as looked up"
    out: dict[str, nn.Module] = {}
    unpacked: dict[str, str] = {}
    for name in targets:
        file_parts = [matrices.get(k) for k in _file_keys(name, head_source)]
        lacking = _lacking(file_parts, packable)
        if lacking:
            unpacked[name] = "+".join(sorted(lacking))
            continue
        parts = [rank_blocks(p, shard) for p in file_parts if p is not None]  # none lacking: all stored
        linear = submodule(model, name, nn.Linear)
        bias = None if linear.bias is None else linear.bias.detach()
        if kernels is not None:
            out[name] = GGUFLinear(parts, kernels, bias)
        else:
            out[name] = Int4Linear(Int4Weight.concat([int4_weight(p) for p in parts]), bias, matmul=matmul)
    if "lm_head" in unpacked or (result.head is None and "lm_head" in result.kept):
        stored = unpacked.pop("lm_head", None) or (head.qtype.name if head is not None else "absent")
        result.head = f"{head_source} ({stored} in the file) dequantized to {dtype}"
    if unpacked:
        runner = "the quantized matmul kernels" if matmul is not None else "aten"
        where = "" if kernels is not None else f" here (no C++ block kernels: only Q4_0/Q4_1 run packed, on {runner})"
        names = [f"{n} ({kind})" for n, kind in unpacked.items()]
        logger.info(
            "gguf: %d layers dequantized to %s, no packed kernel for their block types%s: %s",
            len(names), dtype, where, _summarise(names),
        )  # fmt: skip
    return out


def gguf_layers_from_file(
    model: nn.Module,
    skip: tuple[str, ...],
    matrices: dict[str, GGUFBlocks],
    kernels: ModuleType | None,
    shard: TensorShard | None = None,
) -> dict[str, list[str]]:
    """Before the weights are loaded: the modules (linear layers, the embedding) that quantize_model's
    gguf path will run on the file's own blocks (as _gguf decides), each with the checkpoint tensors
    it is made of, so that loading can leave those tensors out (not dequantized, and the modules'
    dense weights never written). A tied head's table is among them only if the lookup reads the
    blocks too."""
    config = model_config(model)
    packable = kernel_types(kernels) if kernels is not None else ATEN_TYPES
    head_source = head_weight_name(config)
    head = matrices.get(head_source)
    targets, _ = select_linears(model, skip)
    if _packs_head(head, packable, kernels) and "lm_head" not in targets:
        targets.append("lm_head")  # packed whatever quant_skip says (see _gguf)
    packs_table = _packs_embedding(matrices.get(TABLE), packable, kernels, shard)
    layers = {"embed_tokens": [TABLE]} if packs_table else {}
    for name in targets:
        keys = _file_keys(name, head_source)
        if not _lacking([matrices.get(k) for k in keys], packable) and (packs_table or TABLE not in keys):
            layers[name] = keys
    return layers


def _packs_head(head: GGUFBlocks | None, packable: frozenset[GGMLQuantizationType], kernels: ModuleType | None) -> bool:
    """The LM head runs on the file's blocks whenever the block kernels take its type (quant_skip aside)."""
    return kernels is not None and head is not None and head.qtype in packable


def _packs_embedding(
    table: GGUFBlocks | None,
    packable: frozenset[GGMLQuantizationType],
    kernels: ModuleType | None,
    shard: TensorShard | None,
) -> bool:
    """The lookup reads the table's blocks where the block kernels take its type, except on a
    tensor-parallel rank (VocabParallelEmbedding wraps a dense shard)."""
    return shard is None and _packs_head(table, packable, kernels)


def _file_keys(name: str, head_source: str) -> list[str]:
    """The file tensors a targeted module is made of: the head reads its own or the tied table."""
    return [head_source] if name == "lm_head" else _part_keys(name)


def _lacking(parts: list[GGUFBlocks | None], packable: frozenset[GGMLQuantizationType]) -> set[str]:
    """Why these file tensors cannot run packed: the types (or absence) the kernels do not take."""
    return {p.qtype.name if p else "absent" for p in parts if p is None or p.qtype not in packable}


def _part_keys(name: str) -> list[str]:
    """The checkpoint matrices a targeted module is made of (a fused module stacks its parts)."""
    _, _, suffix = name.partition("layers.")
    layer, _, kind = suffix.partition(".")
    return (
        [f"model.layers.{layer}.{p}.weight" for p in _FUSED_PARTS.get(kind, (kind,))] if suffix else [f"{name}.weight"]
    )


def _input_columns(shard: TensorShard, key: str) -> tuple[int, int, int]:
    """The rank's input columns start:stop of checkpoint matrix `key`, and its whole width."""
    full = shard.full_in_features(key)
    index = shard.index(key, ())
    start, stop, _ = (index[1] if index is not None and len(index) > 1 else slice(None)).indices(full)
    return start, stop, full


def _shard_columns(shard: TensorShard, key: str, group: int, what: str, instead: str) -> slice:
    """The rank's input columns of checkpoint matrix `key`, which must start and end on its groups
    (quantization groups, GGUF blocks): else a rank's groups would not be the whole model's."""
    start, stop, full = _input_columns(shard, key)
    if start % group or stop % group:
        raise ConfigError(
            f"tensor_parallel_size={shard.size} would split {key} ({what} of {group} inputs) at input columns "
            f"{start}:{stop} of {full}, cutting a group; accepted: a tensor_parallel_size whose splits fall on "
            f"multiples of {group}, or {instead}"
        )
    return slice(start, stop)


def rank_blocks(blocks: GGUFBlocks, shard: TensorShard | None) -> GGUFBlocks:
    """The rank's part of a GGUF matrix, its blocks kept as the file stores them."""
    if shard is None:
        return blocks
    index = shard.index(blocks.name, ())
    rows = slice(None) if index is None else index[0]
    cols = _shard_columns(
        shard,
        blocks.name,
        GGML_QUANT_SIZES[blocks.qtype][0],
        f"{blocks.qtype.name} blocks",
        "a file of 32-wide blocks there (Q8_0, Q5_0, Q4_0, Q4_1)",
    )
    vocab = blocks.name.removeprefix("model.") in ("embed_tokens.weight", "lm_head.weight")
    return blocks.part(rows, cols, shard.vocab_per_rank if vocab else None)


def _prequantized(
    model: nn.Module,
    targets: list[str],
    weights: PrequantizedWeights,
    result: QuantizationResult,
    kernels: ModuleType | None,
    matmul: ModuleType | None,
) -> dict[str, nn.Module]:
    """The checkpoint's own codes for each targeted linear (fused modules stack their parts); what
    the kernels cannot run exactly keeps the dequantized weight the model was loaded with."""
    if weights.format.activations:
        logger.info(
            "%s: activations quantized as %s in the checkpoint run unquantized (weight-only, as W%dA16): "
            "the C++ kernels round them per 32 inputs instead (quant_activation_bits)",
            weights.format.method, weights.format.activations, weights.format.bits or 8,
        )  # fmt: skip
    out, rounding = {}, 0.0
    for name in targets:
        prefix, _, suffix = name.partition("layers.")
        layer, _, kind = suffix.partition(".")
        parts = _FUSED_PARTS.get(kind, (kind,)) if suffix else (name,)
        keys = [f"model.layers.{layer}.{p}" for p in parts] if suffix else [name]
        packed = read_parts(weights, keys)
        if packed is None:
            result.kept[name] = "stored unquantized in the checkpoint"
            continue
        linear = submodule(model, name, nn.Linear)
        bias = None if linear.bias is None else linear.bias.detach()
        built = build(packed, bias, kernels, linear.weight.device, matmul)
        if built.module is None:
            result.kept[name] = f"{built.why}: dequantized to {linear.weight.dtype}"
            continue
        out[name] = built.module
        rounding = max(rounding, built.fp16_rounding)
    if rounding > 0:
        logger.info(
            "%s: the C++ blocks hold scales (and mins, -scale * zero) in fp16: weights move by up to %.2g of a "
            "quantization step (codes are kept exactly)", weights.format.method, rounding,
        )  # fmt: skip
    return out


def _log(method: str, result: QuantizationResult, groups: dict[str, int]) -> None:
    sizes = sorted({groups[n] for n in result.quantized if n in groups})
    logger.info(
        "quantization %s%s: %d linear layers quantized, weights %.1f MiB -> %.1f MiB",
        method, f" (group size {'/'.join(map(str, sizes))})" if sizes and method != "gguf" else "",
        len(result.quantized), result.bytes_before / 2**20, result.bytes_after / 2**20,
    )  # fmt: skip
    logger.debug("quantized layers: %s", ", ".join(result.quantized))
    if result.head is not None:
        logger.info("lm_head: %s", result.head)
    if result.embedding is not None:
        logger.info("embed_tokens: %s", result.embedding)
    reasons: dict[str, list[str]] = {}
    for name, why in result.kept.items():
        reasons.setdefault(why, []).append(name)
    for why, names in reasons.items():
        logger.info("left unquantized (%s): %s", why, _summarise(names))


def _summarise(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} ... ({len(names)} layers)"


# The linears whose weights are stored quantized (the modules the functions above put in place).
QUANTIZED_LINEARS = (Int4Linear, Int8Linear, GGUFLinear, Fp8Linear)


def quantized_weight_bytes(model: nn.Module) -> int:
    """Parameters plus the quantized modules' buffers (build_model leaves out an embedding table
    that is only gathered from)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, QUANTIZED_LINEARS):
            total += module_bytes(m) - sum(p.numel() * p.element_size() for p in m.parameters())
    return total
