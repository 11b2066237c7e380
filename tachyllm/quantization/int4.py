"""int4 weight-only quantization: asymmetric, group-wise along the input dimension.

A weight row is cut into groups of `group_size` inputs; each group stores a scale and a minimum
and w ≈ code * scale + min with codes 0..15. That is exactly llama.cpp's Q4_1 block (group 32), so
GGUF Q4_1/Q4_0 weights load into this layout without re-rounding (see gguf_packed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from gguf import GGMLQuantizationType
from torch import nn

INT4_MAX = 15
# Group sizes we expose (all accepted by aten._weight_int4pack_mm_for_cpu, the fallback CPU kernel).
GROUP_SIZES = (32, 64, 128)
# Block size of tachyllm's C++ kernels (kernels/csrc/quant_gemv.cpp): GGUF's 32 weights.
BLOCK = 32
# Activation rounding of those kernels, per 32-block (EngineConfig.quant_activation_bits): 16 = two
# int8 parts (x ≈ s/256 * (256 q + q2)), or 8 = llama.cpp's Q8_1. One decode token costs the same
# either way (the weights' bytes set the time); batched steps cost more dot products at 16. 8 bits
# strays further from the fp32 engine's distributions, by how much depends on the model, so 16 is
# the layers' own default and 8 is taken where asked for or where gguf's load-time check allows it
# (quantization/activation_bits.py). One setting for every row count keeps a row's result
# independent of the batch it runs in (prefill, decode, speculative verification).
ACTIVATION_BITS = 16
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activations the kernels take (and return)


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

    With the backend's block kernels (Backend.block_kernels, `kernel == "blocks"`): 16-row tiles of
    Q4_1 blocks with fp16 (d, m) (quant_gemv.cpp); activations are rounded per 32 inputs
    (ACTIVATION_BITS) and each block is an integer dot product. Groups of 64/128 are stored as
    32-blocks sharing (d, m): 0.625 byte per weight instead of aten's 0.5625. No row threshold: this
    kernel beat aten's at every row count measured, so prefill and decode both use it and aten's
    layout is not kept (no second copy of the weights). At one row it streams at the machine's read
    bandwidth (measurements: docs/design_measurements.md#int4-kernels).
    With the backend's quantized matmul kernels (Backend.quantized_matmul_kernels, `"triton"`):
    their packed layout (kernels/triton/quant_matmul.py), codes, scales and mins exact, dequantized
    inside the GEMM's tile loop, for every row count. CPU without either (`"aten"`): aten's packed
    int4 layout with bf16 (scale, zero) pairs; the kernel computes (code - 8) * scale + zero, so
    zero = min + 8 * scale. Other devices (`"dequantize"`): nibble-packed codes, dequantized for each
    matmul. An optional per-input-channel `input_scale` (AWQ) multiplies x first.
    """

    # Registered buffers (register_buffer in __init__), typed for the checker.
    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None,
        input_scale: torch.Tensor | None = None,
        kernels: ModuleType | None = None,
        matmul: ModuleType | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.group_size = weight.group_size
        device = weight.codes.device
        ops = kernels if self.group_size % BLOCK == 0 else None
        if matmul is not None:
            self.kernel = "triton"
        else:
            self.kernel = "blocks" if ops is not None else "aten" if device.type == "cpu" else "dequantize"
        if self.kernel == "triton":
            assert matmul is not None, "the triton kernel is chosen only with matmul kernels"
            packed, scales, mins = matmul.pack_int4(weight.codes, weight.scales, weight.mins, self.group_size)
            self.register_buffer("packed", packed)
            self.register_buffer("scales", scales)
            self.register_buffer("mins", mins)
            self._matmul = matmul.int4_matmul
        elif ops is not None:
            per_block = self.group_size // BLOCK
            scales, mins = (t.repeat_interleave(per_block, dim=1) for t in (weight.scales, weight.mins))
            self.register_buffer("packed", ops.quant_pack_q4_1(weight.codes, scales, mins))
            self._gemv = ops.quant_gemv_q4_1  # the kernel this layout was packed for
            self.layout = torch.tensor([[int(GGMLQuantizationType.Q4_1), self.out_features]])  # for decode_layer.cpp
        elif self.kernel == "aten":
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.int(), 1))
            zeros = weight.mins + 8 * weight.scales
            self.register_buffer(
                "scales_zeros", torch.stack([weight.scales, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
            )
        else:
            self.register_buffer("packed", pack_nibbles(weight.codes))
            self.register_buffer("scales", weight.scales.to(torch.bfloat16))
            self.register_buffer("mins", weight.mins.to(torch.bfloat16))
        self.bias = bias
        self.input_scale = None if input_scale is None else input_scale.to(torch.bfloat16)
        self.activation_bits = ACTIVATION_BITS  # the block kernels' rounding; resolve_activation_bits sets it

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group_size: int, kernels: ModuleType | None = None, matmul: ModuleType | None = None
    ) -> Int4Linear:
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(quantize_int4(linear.weight.detach(), group_size), bias, kernels=kernels, matmul=matmul)

    def native_spec(self) -> tuple | None:
        """This layer for the fused C++ decode layer (kernels/csrc/decode_layer.cpp), if it runs the kernel."""
        if self.kernel != "blocks" or self.input_scale is not None:
            return None
        return (1, self.packed, self.bias, self.out_features, self.activation_bits, -1, self.layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "blocks" and self.input_scale is None and self.bias is None and x.dtype in KERNEL_DTYPES:
            # The decode path: one call (each extra torch op costs a sizeable share of the kernel's own
            # time; measurements: docs/design_measurements.md#int4-kernels).
            return self._gemv(x, self.packed, self.out_features, self.activation_bits)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "triton":
            if self.input_scale is not None:
                x2 = x2 * self.input_scale.to(x2.device, x2.dtype)
            y = self._matmul(x2, self.packed, self.scales, self.mins, self.group_size, self.bias)
            return y.view(*shape[:-1], self.out_features)
        if self.input_scale is not None:
            x2 = x2.to(torch.bfloat16) * self.input_scale.to(x2.device)
        if self.kernel == "blocks":
            y = self._gemv(
                x2 if x2.dtype in KERNEL_DTYPES else x2.float(), self.packed, self.out_features, self.activation_bits
            )
        elif self.kernel == "aten":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(torch.bfloat16), self.packed, self.group_size, self.scales_zeros
            )
        else:
            g = self.group_size
            codes = unpack_nibbles(self.packed).to(torch.bfloat16).view(self.out_features, -1, g)
            w = (codes * self.scales[..., None] + self.mins[..., None]).view(self.out_features, -1)
            y = x2.to(torch.bfloat16) @ w.t()
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)
