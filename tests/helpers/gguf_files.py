"""Pieces of the tiny GGUF files that tests write themselves: the model-shape metadata, one decoder
layer's tensors in llama.cpp's names and order, closing a writer, random valid blocks of any
quantized type, and a byte-level tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

# add(name, *shape, quantize=True): writes one tensor; norms are written with quantize=False.
AddTensor = Callable[..., None]


def add_llama_shape(
    writer: GGUFWriter, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, context: int = 256
) -> None:
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)


def add_layer_tensors(
    add: AddTensor, layer: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int
) -> None:
    add(f"blk.{layer}.attn_norm.weight", hidden, quantize=False)
    add(f"blk.{layer}.ffn_norm.weight", hidden, quantize=False)
    add(f"blk.{layer}.attn_q.weight", heads * head_dim, hidden)
    add(f"blk.{layer}.attn_k.weight", kv_heads * head_dim, hidden)
    add(f"blk.{layer}.attn_v.weight", kv_heads * head_dim, hidden)
    add(f"blk.{layer}.attn_output.weight", hidden, heads * head_dim)
    add(f"blk.{layer}.ffn_gate.weight", ffn, hidden)
    add(f"blk.{layer}.ffn_up.weight", ffn, hidden)
    add(f"blk.{layer}.ffn_down.weight", hidden, ffn)


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Offsets of each block type's fp16 fields (d, and m / dmin where it has one) in its bytes, and a
# typical |code x sub-block scale| to size d so that weights come out around the requested amplitude.
HALF_FIELDS = {
    GGMLQuantizationType.Q4_0: ((0,), 8),
    GGMLQuantizationType.Q4_1: ((0, 2), 8),
    GGMLQuantizationType.Q5_0: ((0,), 16),
    GGMLQuantizationType.Q5_1: ((0, 2), 16),
    GGMLQuantizationType.Q8_0: ((0,), 64),
    GGMLQuantizationType.Q4_K: ((0, 2), 250),
    GGMLQuantizationType.Q5_K: ((0, 2), 500),
    GGMLQuantizationType.Q6_K: ((208,), 1000),
}


def random_blocks(
    kind: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator, amplitude: float = 0.1
) -> np.ndarray:
    """Random but valid GGUF blocks, uint8 [rows, bytes per row]: any codes and packed sub-block
    scales / mins (the gguf package cannot quantize K-quants), finite fp16 scales of either sign."""
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, typical = HALF_FIELDS[kind]
    for at in offsets:
        d = rng.uniform(-amplitude, amplitude, (rows, cols // block, 1)) / typical
        raw[..., at : at + 2] = d.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def add_byte_level_tokenizer(writer: GGUFWriter) -> int:
    """GPT-2's printable stand-ins for the 256 bytes, one merge ("he") and an EOS; returns the vocabulary size."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    stand_ins = {b: chr(b) for b in keep} | {
        b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in keep)
    }
    tokens = [stand_ins[b] for b in range(256)] + ["he", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["h e"])
    writer.add_eos_token_id(len(tokens) - 1)
    return len(tokens)


# -- a tiny Q4_K_M-like model ---------------------------------------------------------------------
T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


HIDDEN, HEADS, KV_HEADS, FFN = 256, 4, 2, 512  # K-quants need inputs in multiples of 256


# Per layer, llama.cpp's Q4_K_M choices (Q4_K, with Q6_K for some attn_v / ffn_down) and the
# fallbacks its smaller models get (Q5_0, Q8_0); every type appears, fused modules mix them.
Q4_K_M_LIKE = [
    {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
     "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K},
    {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q5_K,
     "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q4_K},
]  # fmt: skip


def write_mixed_gguf(
    path: Path,
    layers: list[dict[str, GGMLQuantizationType]],
    head: GGMLQuantizationType | None,
    table: GGMLQuantizationType = T.Q4_K,
    table_rows: int | None = None,
) -> Path:
    """A llama GGUF with each layer's matrices in the given types, a token_embd of type `table` and an
    output.weight of type `head` (None: none, the head tied to token_embd); random valid blocks, F32 norms.
    `table_rows`: token_embd's rows if not the vocabulary's (a malformed file)."""
    rng = np.random.default_rng(5)
    writer = GGUFWriter(path, "llama")
    add_llama_shape(writer, layers=len(layers), hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, context=128)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = add_byte_level_tokenizer(writer)

    def matrix(name: str, kind: GGMLQuantizationType, rows: int, cols: int) -> None:
        if kind in (T.F16, T.F32):
            dtype = np.float16 if kind == T.F16 else np.float32
            writer.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(dtype))
        else:
            writer.add_tensor(name, random_blocks(kind, rows, cols, rng), raw_dtype=kind)

    matrix("token_embd.weight", table, table_rows or vocab, HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    if head is not None:
        matrix("output.weight", head, vocab, HIDDEN)
    for i, types in enumerate(layers):

        def add(name: str, *shape: int, quantize: bool = True, types=types) -> None:
            if quantize:
                matrix(name, types[name.split(".")[2]], *shape)
            else:
                writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))

        add_layer_tensors(add, i, HIDDEN, HEADS, KV_HEADS, HIDDEN // HEADS, FFN)
    finish(writer)
    return path


TINY_HIDDEN, TINY_HEADS, TINY_KV_HEADS, TINY_FFN = 64, 4, 2, 128  # the tiny HF test model's shapes


def write_tiny_q4_1_gguf(path: Path, embedding: GGMLQuantizationType) -> Path:
    """A two-layer llama GGUF with Q4_1 layers and a tied token_embd of the given type."""
    rng = np.random.default_rng(1)
    writer = GGUFWriter(path, "llama")
    add_llama_shape(
        writer, layers=2, hidden=TINY_HIDDEN, ffn=TINY_FFN, heads=TINY_HEADS, kv_heads=TINY_KV_HEADS, context=128
    )
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = add_byte_level_tokenizer(writer)

    def tensor(name: str, *shape: int, kind: GGMLQuantizationType | None = GGMLQuantizationType.Q4_1) -> None:
        data = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if kind is None:
            writer.add_tensor(name, np.abs(data) + 0.5)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    tensor("token_embd.weight", vocab, TINY_HIDDEN, kind=embedding)
    tensor("output_norm.weight", TINY_HIDDEN, kind=None)

    def add(name: str, *shape: int, quantize: bool = True) -> None:
        tensor(name, *shape, kind=GGMLQuantizationType.Q4_1 if quantize else None)

    for i in range(2):
        add_layer_tensors(add, i, TINY_HIDDEN, TINY_HEADS, TINY_KV_HEADS, TINY_HIDDEN // TINY_HEADS, TINY_FFN)
    finish(writer)
    return path
