"""build_model: a loaded checkpoint -> a ready model of its family (models.model_class) for a backend (weights, rotary
table, optional weight-only quantization, CPU weight packing, the backend's fused layers), and the
bytes a decode step streams."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from tachyllm import huge_pages
from tachyllm.backends.base import Backend
from tachyllm.config import QuantConfig
from tachyllm.errors import ConfigError
from tachyllm.kernels.linear import fuse_gelu, onednn_packing_available, pack_linears, packing_available
from tachyllm.loading import Checkpoint
from tachyllm.models import model_class
from tachyllm.models.bert import BertLayer, BertModel, encoder_class
from tachyllm.models.llama import LlamaForCausalLM
from tachyllm.quantization import quantize_model, quantized_weight_bytes
from tachyllm.quantization.activation_bits import resolve_activation_bits
from tachyllm.quantization.apply import TensorShard, gguf_layers_from_file
from tachyllm.quantization.gguf_packed import gguf_matrices
from tachyllm.quantization.int4 import ACTIVATION_BITS
from tachyllm.quantization.policy import parse_skip


def build_model(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    backend: Backend,
    max_model_len: int,
    quant: QuantConfig = QuantConfig(),
    *,
    batch_invariant: bool = False,
    fuse_layers: bool = True,
    shard: TensorShard | None = None,
    head_token_ids: torch.Tensor | None = None,
) -> tuple[LlamaForCausalLM, int]:
    """`batch_invariant`: every token's result independent of what else the step computes
    (docs/determinism.md). `fuse_layers`: give the layers the backend's fused form (not for a
    tensor-parallel shard, whose layers join collectives the fused call has no place for).
    `shard`: the tensor-parallel rank `ckpt` is the share of, whose layers quantize as the whole model's.
    `head_token_ids`: the vocabulary rows the LM head keeps (LlamaForCausalLM.keep_head_rows); None: all.
    `quant`: the weights' quantization (its activation_bits: the block kernels' activation rounding; None:
    quantization/activation_bits.py's rule)."""
    device = backend.device
    quantization = quant.method  # a pre-quantized checkpoint's own method when unset (below)
    with torch.device("meta"):
        model = model_class(ckpt.config)(ckpt.config, backend.ops).to(dtype)  # casting on meta costs nothing
    model = model.to_empty(device=device)
    from_file, blocks = {}, None
    if quantization == "gguf" and ckpt.format == "gguf":
        blocks = gguf_matrices(ckpt.source, ckpt.config if shard is None else shard.full, ckpt.stored_tensors)
        # Layers that will run on the file's blocks are not loaded dense first (a tensor-parallel rank's
        # parts neither): a Q4_K_M 1.5B model's dense copy was 3.5 GB of bf16 written only to be
        # replaced (docs/benchmarks.md#loading-and-start-up).
        from_file = gguf_layers_from_file(model, parse_skip(quant.skip), blocks, backend.block_kernels(), shard)
    left_out = frozenset(key for keys in from_file.values() for key in keys)
    weights = ckpt.weights(None, left_out) if left_out else ckpt.weights()
    model.load_weights(weights, unloaded=frozenset(f"{name}.weight" for name in from_file))
    if head_token_ids is not None:
        model.keep_head_rows(head_token_ids)
    model.init_rotary(max_model_len)
    # Bytes a decode step streams from memory (packing below hides parameters from the module).
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - lookup_only_bytes(model)
    if ckpt.prequantized is not None:
        # vLLM's rule: the checkpoint's quantization_config decides; --quantization may only repeat it.
        quantization = quantization or ckpt.prequantized.format.method
        if quant.group_size is not None:
            raise ConfigError("quant_group_size does not apply to a pre-quantized checkpoint (its groups are stored)")
    elif quantization is None and quant.activation_bits not in (None, ACTIVATION_BITS):
        raise ConfigError("quant_activation_bits applies to quantized weights; set quantization (int4, awq, gguf)")
    if quantization:
        # Quantized modules run their own kernels; pack_linears below only packs what is left (lm_head).
        skip = parse_skip(quant.skip)
        kernels = backend.block_kernels()
        quantize_model(
            model, quantization, quant.group_size, skip, ckpt.tokenizer, blocks, kernels, ckpt.prequantized,
            backend.quantized_matmul_kernels(), shard,
        )  # fmt: skip
        resolve_activation_bits(
            model, quantization, quant.activation_bits, ckpt.tokenizer, sharded=shard is not None, source=ckpt.source
        )
        weight_bytes = quantized_weight_bytes(model) - lookup_only_bytes(model)
    dense = [name for name in from_file if isinstance(model.get_submodule(name), nn.Linear | nn.Embedding)]
    if dense:
        raise RuntimeError(f"layers left unloaded for the GGUF blocks were not replaced by them: {dense}")
    if device.type == "cpu":
        bf16_kernels = backend.bf16_linear_kernels()
        if packing_available(dtype, bf16_kernels):
            pack_linears(model, bf16_kernels, batch_invariant)
        table = lookup_only_table(model)
        huge_pages.move_weights(model, leave=[] if table is None else [table])  # before the fused layers take them
    if fuse_layers:
        model.fuse_layers(backend)
    return model.eval(), weight_bytes


def build_encoder(
    ckpt: Checkpoint, dtype: torch.dtype, backend: Backend, quant: QuantConfig = QuantConfig(), *, batch_invariant: bool
) -> tuple[BertModel, int]:
    """An encoder checkpoint (BERT) as a ready model: weights loaded, plain linears packed for oneDNN
    where it packs the dtype, else for the CPU's bf16 kernel; returns it and its weight bytes. Weight
    quantization is not offered for encoders (small models, whose step is dominated by attention and
    activations)."""
    if quant.method is not None or ckpt.prequantized is not None:
        raise ConfigError("weight quantization is not supported for encoder (BERT) models")
    with torch.device("meta"):
        model = encoder_class(ckpt.config)(ckpt.config, backend.ops).to(dtype)
    model = model.to_empty(device=backend.device)
    model.load_weights(ckpt.weights())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if backend.device.type == "cpu":
        # An encoder step is a matrix-matrix product over every token of its inputs (hundreds of rows),
        # where oneDNN's prepacked bf16 GEMM beats the matrix-vector kernel made for decoding
        # (docs/design_measurements.md#encoder-linears); its sums do not depend on the row count either
        # (PackedLinear computes a lone row as two), so the step stays batch invariant.
        bf16_kernels = None if onednn_packing_available(dtype) else backend.bf16_linear_kernels()
        if packing_available(dtype, bf16_kernels):
            pack_linears(model, bf16_kernels, batch_invariant)
            for layer in cast("list[BertLayer]", model.layers):
                if fuse_gelu(layer.up_proj):  # GELU as the GEMM's post-op: one pass less over the MLP's rows
                    layer.activation = nn.Identity()
    return model.eval(), weight_bytes


def lookup_only_table(model: LlamaForCausalLM) -> torch.Tensor | None:
    """The embedding table (a dense weight, or a GGUFEmbedding's tiles) when no LM head reads it
    (untied, quantized or packed apart from it, or cut to a shortlist): a decode step then reads one
    row of it per token."""
    table = _stored(model.embed_tokens)
    head = _stored(model.lm_head)
    if (
        table is not None
        and head is not None
        and head.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    ):
        return None
    return table


def _stored(module: nn.Module) -> torch.Tensor | None:
    """What an embedding or head module keeps its matrix in: a weight, or packed tiles (GGUF blocks)."""
    return getattr(module, "weight", getattr(module, "packed", None))


def lookup_only_bytes(model: LlamaForCausalLM) -> int:
    """The bytes of a lookup-only table among the model's parameters (a packed table is a buffer,
    which the weight counts leave out already)."""
    table = lookup_only_table(model)
    return table.numel() * table.element_size() if isinstance(table, nn.Parameter) else 0
