"""int8 weight-only quantization: symmetric, one scale per output channel."""

from __future__ import annotations

import torch
from torch import nn

INT8_MAX = 127
# Above this many rows the packed int8 kernel loses to dequantize + bf16 GEMM; at decode sizes it
# is the faster of the two by far (measurements: docs/design_measurements.md#int8-kernel-threshold).
PACKED_MAX_ROWS = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (codes int8 [out, in], scales fp32 [out]) with weight ≈ codes * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    codes = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]


class Int8Linear(nn.Module):
    """On CPU runs aten._weight_int8pack_mm for up to PACKED_MAX_ROWS rows; it is only fast with
    bf16 activations, so inputs are cast to bf16 and the result back to the caller's dtype. Larger
    inputs (prefill chunks, big decode batches) and other devices: dequantize + matmul."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        codes, scales = quantize_int8(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(codes, scales, bias)

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.codes, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.codes.device.type == "cpu" and x2.shape[0] <= PACKED_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.codes, self.scales)
        else:
            dtype = torch.bfloat16 if self.codes.device.type == "cpu" else x.dtype
            y = torch.nn.functional.linear(x2.to(dtype), self.codes.to(dtype) * self.scales.to(dtype)[:, None])
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)
