"""Keeping a GGUF file's blocks packed instead of dequantizing them.

Q4_1 blocks hold 32 weights as w = d * q + m (fp16 d and m, 4-bit q): exactly Int4Weight with
group 32, scale d and min m. Q4_0 blocks are w = d * (q - 8): scale d, min -8d. Both therefore map
without re-rounding (the C++ kernel keeps d and m in fp16, exact; aten's fallback rounds them to
bf16). Q8_0 blocks (w = d * q, 8-bit q) run on the C++ kernel as Q8_0Linear; only the LM head is
decoded that way (small GGUFs such as the default model's store the tied token_embd as Q8_0 and
their layers as Q4). Every other type (K-quants, F16/F32, other Q8_0 tensors) is dequantized and
stays in the model dtype; the caller logs which tensors those are.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from tachyllm.config import ModelConfig
from tachyllm.loading.gguf import fix_rotary_rows, open_gguf, raw_tensors
from tachyllm.quantization import int4
from tachyllm.quantization.int4 import BLOCK, KERNEL_DTYPES, Int4Weight

GGUF_GROUP_SIZE = 32
_Q4_1_BYTES, _Q4_0_BYTES, _Q8_0_BYTES = 20, 18, 34  # bytes per 32-weight block


@dataclass
class Q8_0Weight:
    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # fp32 [out, in // 32], the file's fp16 values

    def dequantize(self) -> torch.Tensor:
        out, k = self.codes.shape
        return (self.codes.float().view(out, k // BLOCK, BLOCK) * self.scales[..., None]).view(out, k)


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


def decode_q8_0(raw: np.ndarray, rows: int) -> Q8_0Weight:
    blocks = raw.reshape(rows, -1, _Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return Q8_0Weight(torch.from_numpy(codes), torch.from_numpy(d))


_DECODERS = {GGMLQuantizationType.Q4_1: decode_q4_1, GGMLQuantizationType.Q4_0: decode_q4_0}


def head_weight_name(config: ModelConfig) -> str:
    """The file tensor the LM head reads: its own output.weight, or the tied token_embd."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def packed_gguf_weights(
    path: str, config: ModelConfig, q8_0: tuple[str, ...] = ()
) -> tuple[dict[str, Int4Weight | Q8_0Weight], dict[str, str]]:
    """HF weight name -> Int4Weight for every Q4_0/Q4_1 matrix, Q8_0Weight for the Q8_0 matrices
    named in `q8_0`; and name -> type of the others."""
    packed, other = {}, {}
    for name, tensor in raw_tensors(open_gguf(path)):
        decode = _DECODERS.get(tensor.tensor_type)
        if tensor.tensor_type == GGMLQuantizationType.Q8_0 and name in q8_0 and len(tensor.shape) == 2:
            w8 = decode_q8_0(np.asarray(tensor.data), int(tensor.shape[1]))
            packed[name] = Q8_0Weight(fix_rotary_rows(w8.codes, name, config), fix_rotary_rows(w8.scales, name, config))
            continue
        if decode is None or len(tensor.shape) != 2:
            other[name] = tensor.tensor_type.name
            continue
        rows = int(tensor.shape[1])  # GGUF lists the fastest dimension (in_features) first
        w = decode(np.asarray(tensor.data), rows)
        packed[name] = Int4Weight(
            fix_rotary_rows(w.codes, name, config),
            fix_rotary_rows(w.scales, name, config),
            fix_rotary_rows(w.mins, name, config),
            GGUF_GROUP_SIZE,
        )
    return packed, other


class Q8_0Linear(nn.Module):
    """A linear layer on Q8_0 blocks with the C++ kernel (16-row tiles, codes stored as q + 128 for
    VNNI's unsigned operand; quant_gemv.cpp). Built only with the backend's block kernels: the
    bf16 alternative is the dequantized table, so there is no slower fallback worth keeping here.
    At the default model's head a one-token step is faster than the bf16 linear on the dequantized
    table (it reads fewer bytes), and about as fast from 16 to 64 rows, where the dot products
    dominate (measurements: docs/design_measurements.md#q8_0-head)."""

    def __init__(self, weight: Q8_0Weight, kernels: ModuleType, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.register_buffer("packed", kernels.quant_pack_q8_0(weight.codes, weight.scales))
        self._gemv = kernels.quant_gemv_q8_0  # the kernel this layout was packed for
        self.bias = bias
        self.activation_bits = int4.ACTIVATION_BITS  # quantize_model sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._gemv(
            x if x.dtype in KERNEL_DTYPES else x.float(), self.packed, self.out_features, self.activation_bits
        )
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)
