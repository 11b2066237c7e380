"""Keeping a GGUF file's 4-bit blocks packed instead of dequantizing them.

Q4_1 blocks hold 32 weights as w = d * q + m (fp16 d and m, 4-bit q): exactly Int4Weight with
group 32, scale d and min m. Q4_0 blocks are w = d * (q - 8): scale d, min -8d. Both therefore map
without re-rounding (only d and m are stored in bf16 by the CPU kernel). Every other type (Q8_0 —
its per-32 scales do not fit the per-channel int8 kernel —, K-quants, F16/F32) is dequantized
and stays in the model dtype; the caller logs which tensors those are.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tachyllm.config import ModelConfig
from tachyllm.loading.gguf import fix_rotary_rows, open_gguf, raw_tensors
from tachyllm.quantization.int4 import Int4Weight

GGUF_GROUP_SIZE = 32
_Q4_1_BYTES, _Q4_0_BYTES = 20, 18  # bytes per 32-weight block


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


_DECODERS = {GGMLQuantizationType.Q4_1: decode_q4_1, GGMLQuantizationType.Q4_0: decode_q4_0}


def packed_gguf_weights(path: str, config: ModelConfig) -> tuple[dict[str, Int4Weight], dict[str, str]]:
    """HF weight name -> Int4Weight for every Q4_0/Q4_1 matrix; and name -> type of the others."""
    packed, other = {}, {}
    for name, tensor in raw_tensors(open_gguf(path)):
        decode = _DECODERS.get(tensor.tensor_type)
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
