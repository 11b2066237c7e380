"""int4 weight-only quantization: asymmetric, group-wise along the input dimension.

A weight row is cut into groups of `group_size` inputs; each group stores a scale and a minimum
and w ≈ code * scale + min with codes 0..15. That is exactly llama.cpp's Q4_1 block (group 32), so
GGUF Q4_1/Q4_0 weights load into this layout without re-rounding (see gguf_packed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

INT4_MAX = 15
# Group sizes the CPU kernel (aten._weight_int4pack_mm_for_cpu) accepts and we expose.
GROUP_SIZES = (32, 64, 128)


@dataclass
class Int4Weight:
    codes: torch.Tensor  # uint8 [out, in], values 0..15
    scales: torch.Tensor  # fp32 [out, in // group_size]
    mins: torch.Tensor  # fp32 [out, in // group_size]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        out, k = self.codes.shape
        g = self.group_size
        w = self.codes.float().view(out, k // g, g) * self.scales[..., None] + self.mins[..., None]
        return w.view(out, k)

    @staticmethod
    def concat(parts: list[Int4Weight]) -> Int4Weight:
        """Stacks weights along the output dimension (fused qkv / gate_up projections)."""
        return Int4Weight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]),
            parts[0].group_size,
        )


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Round-to-nearest asymmetric int4 quantization of an [out, in] weight."""
    out, k = weight.shape
    w = weight.float().view(out, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / INT4_MAX).clamp(min=1e-12)
    codes = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, INT4_MAX).to(torch.uint8)
    return Int4Weight(codes.view(out, k), scales, lo, group_size)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..15 -> [out, in / 2] bytes (even column in the low nibble)."""
    return (codes[:, ::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)


class Int4Linear(nn.Module):
    """Holds int4 weights in the layout of the device's fastest path.

    CPU: aten's packed int4 layout with bf16 (scale, zero) pairs; the kernel computes
    (code - 8) * scale + zero, so zero = min + 8 * scale. Other devices: nibble-packed codes,
    dequantized for each matmul. An optional per-input-channel `input_scale` (AWQ) multiplies x first.
    """

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, input_scale: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.group_size = weight.group_size
        self.cpu_kernel = weight.codes.device.type == "cpu"
        if self.cpu_kernel:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.int(), 1))
            zeros = weight.mins + 8 * weight.scales
            self.register_buffer("scales_zeros", torch.stack([weight.scales, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
        else:
            self.register_buffer("packed", pack_nibbles(weight.codes))
            self.register_buffer("scales", weight.scales.to(torch.bfloat16))
            self.register_buffer("mins", weight.mins.to(torch.bfloat16))
        self.bias = bias
        self.input_scale = None if input_scale is None else input_scale.to(torch.bfloat16)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(quantize_int4(linear.weight.detach(), group_size), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.input_scale is not None:
            x2 = x2 * self.input_scale.to(x2.device)
        if self.cpu_kernel:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)
        else:
            g = self.group_size
            codes = unpack_nibbles(self.packed).to(torch.bfloat16).view(self.out_features, -1, g)
            w = (codes * self.scales[..., None] + self.mins[..., None]).view(self.out_features, -1)
            y = x2 @ w.t()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)
