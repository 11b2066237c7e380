"""Keeping a GGUF file's blocks packed instead of dequantizing them.

With the backend's block kernels (kernels/csrc/quant_gemv.cpp) every matrix stored as Q4_0, Q4_1,
Q5_0, Q8_0, Q4_K, Q5_K or Q6_K (all the types of llama.cpp's Q4_K_M / Q5_K_M / Q8_0 files) runs on
its own blocks as a GGUFLinear: the file's bytes are repacked into the kernel's 16-row tiles at load,
codes and scales untouched, so the weights the kernel multiplies are exactly the ones the gguf
package's dequantization gives. A fused module (q/k/v, gate/up) whose parts the file stores in
different types (Q4_K_M keeps some attn_v as Q6_K or Q8_0 beside Q4_K q/k) is one GGUFLinear whose
parts keep their own types.

Without those kernels, Q4_1 blocks (w = d * q + m) are exactly Int4Weight with group 32 (scale d,
min m) and Q4_0 blocks (w = d * (q - 8)) scale d, min -8d, for aten's int4 kernel (which rounds d and
m to bf16). Every other type, and F16/F32 matrices, is dequantized and stays in the model dtype; the
caller logs which tensors those are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from torch import nn

from tachyllm.loading.gguf import fix_rotary_rows, open_gguf, raw_tensors
from tachyllm.model_config import ModelConfig
from tachyllm.quantization import int4
from tachyllm.quantization.int4 import KERNEL_DTYPES, Int4Weight

GGUF_GROUP_SIZE = 32
_Q4_1_BYTES, _Q4_0_BYTES = 20, 18  # bytes per 32-weight block
# What aten's int4 kernel can take without the block kernels.
ATEN_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})


@dataclass
class GGUFBlocks:
    """One matrix as the file stores it: each row a run of GGML blocks."""

    name: str  # HF weight name
    qtype: GGMLQuantizationType
    raw: np.ndarray  # uint8 [out_features, bytes per row], a view of the memory-mapped file
    in_features: int
    config: ModelConfig | None  # None: rows already in the model's order (blocks not from a GGUF file)

    def rows(self) -> torch.Tensor:
        """The blocks as a uint8 tensor (a copy) with rows in the model's order (llama q/k rows
        have llama.cpp's rotary permutation undone: whole rows move, so any block type can)."""
        rows = torch.from_numpy(self.raw.copy())
        return rows if self.config is None else fix_rotary_rows(rows, self.name, self.config)

    def part(self, rows: slice, cols: slice, total_rows: int | None = None) -> GGUFBlocks:
        """A tensor-parallel rank's rows (in the model's order) and columns (whole blocks: the caller
        checked) of the matrix, with zero blocks (weights 0) appended up to `total_rows`, the padding
        of the last vocabulary shard."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        start, stop, _ = cols.indices(self.in_features)
        data = self.rows()[rows, start // block * size : stop // block * size]
        if total_rows is not None and data.shape[0] < total_rows:
            data = torch.cat([data, data.new_zeros(total_rows - data.shape[0], data.shape[1])])
        return GGUFBlocks(self.name, self.qtype, data.contiguous().numpy(), stop - start, None)


def q8_0_matrix(codes: torch.Tensor, scales: torch.Tensor) -> GGUFBlocks:
    """int8 codes [out, in] with one scale per 32 of them [out, in / 32] as Q8_0 blocks (each an fp16
    scale, then its 32 codes), for weights from elsewhere than a GGUF file (pre-quantized checkpoints)."""
    out, k = codes.shape
    d = scales.to(torch.float16).contiguous().view(torch.uint8).reshape(out, k // 32, 2)
    q = codes.to(torch.int8).contiguous().view(torch.uint8).reshape(out, k // 32, 32)
    return GGUFBlocks("", GGMLQuantizationType.Q8_0, torch.cat([d, q], dim=2).reshape(out, -1).numpy(), k, None)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def decode_q4_1(raw: np.ndarray, rows: int) -> Int4Weight:
    blocks = raw.reshape(rows, -1, _Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = _nibbles(blocks[..., 4:]).reshape(rows, -1)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m), GGUF_GROUP_SIZE)


def decode_q4_0(raw: np.ndarray, rows: int) -> Int4Weight:
    blocks = raw.reshape(rows, -1, _Q4_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = _nibbles(blocks[..., 2:]).reshape(rows, -1)
    return Int4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(-8 * d), GGUF_GROUP_SIZE)


def int4_weight(blocks: GGUFBlocks) -> Int4Weight:
    """A Q4_0 / Q4_1 matrix as Int4Weight (aten's int4 kernel), rows in the model's order."""
    decode = decode_q4_1 if blocks.qtype == GGMLQuantizationType.Q4_1 else decode_q4_0
    w = decode(np.asarray(blocks.raw), blocks.raw.shape[0])
    if blocks.config is None:
        return w
    codes, scales, mins = (fix_rotary_rows(t, blocks.name, blocks.config) for t in (w.codes, w.scales, w.mins))
    return Int4Weight(codes, scales, mins, GGUF_GROUP_SIZE)


TABLE = "model.embed_tokens.weight"  # the token embedding table's checkpoint name


def head_weight_name(config: ModelConfig) -> str:
    """The file tensor the LM head reads: its own output.weight, or the tied token_embd."""
    return TABLE if config.tie_word_embeddings else "lm_head.weight"


def gguf_matrices(
    path: str, config: ModelConfig, stored: Iterable[tuple[str, ReaderTensor]] | None = None
) -> dict[str, GGUFBlocks]:
    """HF weight name -> the file's blocks, for every 2-D tensor (nothing is copied yet). `stored`: the
    file's (HF name, tensor) table if the caller has it (Checkpoint.stored_tensors), else it is parsed."""
    out = {}
    for name, tensor in raw_tensors(open_gguf(path)) if stored is None else stored:
        if len(tensor.shape) == 2:
            rows = int(tensor.shape[1])  # GGUF lists the fastest dimension (in_features) first
            raw = np.asarray(tensor.data).reshape(rows, -1)
            out[name] = GGUFBlocks(name, tensor.tensor_type, raw, int(tensor.shape[0]), config)
    return out


def kernel_types(kernels: ModuleType) -> frozenset[GGMLQuantizationType]:
    """The block types the C++ kernels multiply packed."""
    return frozenset(GGMLQuantizationType(t) for t in kernels.quant_gguf_formats())


class GGUFLinear(nn.Module):
    """A linear layer on a GGUF file's own blocks with the C++ kernels (quant_gemv.cpp): the parts
    (one matrix, or the q/k/v or gate/up matrices of a fused module, each in its stored type) are
    repacked once into 16-row tiles and multiplied in one call, which rounds the activations once
    per 32 inputs (`activation_bits`) and writes each part's output columns. Built only with the
    backend's block kernels: the alternative is the dequantized weight the model already holds.
    One-token steps stream the tiles at about the file's own bytes per weight (Q4_K 0.59, Q6_K
    0.83, Q5_0 0.69, Q8_0 1.06)."""

    # Registered buffers (register_buffer in __init__), typed for the checker.
    packed: torch.Tensor

    def __init__(self, parts: list[GGUFBlocks], kernels: ModuleType, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = parts[0].in_features
        if any(p.in_features != self.in_features for p in parts):
            raise ValueError(f"GGUFLinear: parts {[p.name for p in parts]} have different in_features")
        self.out_features = sum(p.raw.shape[0] for p in parts)
        tiles = [kernels.quant_pack_gguf(int(p.qtype), p.rows(), p.in_features) for p in parts]
        self.register_buffer("packed", tiles[0] if len(tiles) == 1 else torch.cat(tiles))  # cat copies even one
        # (GGML block type, rows) per part: a few bytes, not a buffer (weight byte counts skip it).
        self.layout = torch.tensor([[int(p.qtype), p.raw.shape[0]] for p in parts], dtype=torch.int64)
        self.block_types = "+".join(p.qtype.name for p in parts)
        self._gemv = kernels.quant_gemv
        self.bias = bias
        self.activation_bits = int4.ACTIVATION_BITS  # resolve_activation_bits (activation_bits.py) sets it

    def native_spec(self) -> tuple:
        """This layer for the fused C++ decode layer (kernels/csrc/decode_layer.cpp)."""
        return (1, self.packed, self.bias, self.out_features, self.activation_bits, -1, self.layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._gemv(x if x.dtype in KERNEL_DTYPES else x.float(), self.packed, self.layout, self.activation_bits)
        if self.bias is not None:
            y.add_(self.bias)  # as the fused decode layer adds it: the same bits on either path
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.block_types}"


class GGUFEmbedding(nn.Module):
    """The token embedding lookup on a GGUF table's blocks, packed as GGUFLinear's tiles: each step
    dequantizes only the rows it looks up (quant_rows: the gguf package's values exactly, in the
    model dtype), so the table stays at the file's bytes instead of a dequantized copy (Qwen2.5-
    Coder-1.5B's Q4_K table: 139 MB instead of 467 MB of bf16). A tied LM head on the same blocks
    shares the tiles: one copy serves both."""

    # Registered buffers (register_buffer in __init__), typed for the checker.
    packed: torch.Tensor

    def __init__(self, packed: torch.Tensor, layout: torch.Tensor, embedding_dim: int, dtype: torch.dtype,
                 kernels: ModuleType):  # fmt: skip
        super().__init__()
        self.register_buffer("packed", packed)
        self.layout = layout
        self.num_embeddings, self.embedding_dim = int(layout[0, 1]), embedding_dim
        self.dtype = dtype
        self._rows = kernels.quant_rows

    @classmethod
    def from_blocks(cls, blocks: GGUFBlocks, dtype: torch.dtype, kernels: ModuleType) -> GGUFEmbedding:
        """The lookup on tiles of its own (packed as a one-part GGUFLinear's)."""
        return cls.sharing(GGUFLinear([blocks], kernels), dtype, kernels)

    @classmethod
    def sharing(cls, head: GGUFLinear, dtype: torch.dtype, kernels: ModuleType) -> GGUFEmbedding:
        """The lookup on a one-part GGUFLinear's tiles: a tied model's head on the whole table."""
        return cls(head.packed, head.layout, head.in_features, dtype, kernels)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._rows(self.packed, self.layout, input_ids, self.embedding_dim, self.dtype)

    def extra_repr(self) -> str:
        blocks = GGMLQuantizationType(int(self.layout[0, 0])).name
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={blocks}, dtype={self.dtype}"
