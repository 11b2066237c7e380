"""Pieces of the tiny GGUF files that tests write themselves: the model-shape metadata, one decoder
layer's tensors in llama.cpp's names and order, and closing a writer."""

from __future__ import annotations

from collections.abc import Callable

from gguf import GGUFWriter

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
