"""int8 weight-only quantization: symmetric, one scale per output channel."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

INT8_MAX = 127
# Above this many rows the packed int8 kernel loses to dequantize + bf16 GEMM; at decode sizes it
# is the faster of the two by far (measurements: docs/design_measurements.md#int8-kernel-threshold).
PACKED_MAX_ROWS = 16


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """Each output channel's largest |w| (fp32 [out]), which sets its scale."""
    return weight.float().abs().amax(dim=1)


def quantize_int8(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (codes int8 [out, in], scales fp32 [out]) with weight ≈ codes * scales[:, None].
    `amax`: the rows' largest |w| when `weight` holds only some of their columns (a tensor-parallel
    rank's part of a row-parallel layer), so that its codes are the whole row's."""
    w = weight.float()
    scales = (row_amax(w) if amax is None else amax).clamp(min=1e-12) / INT8_MAX
    codes = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]


class Int8Linear(nn.Module):
    """With the backend's quantized matmul kernels (Backend.quantized_matmul_kernels): their int8
    GEMM, which applies the per-channel scales to its fp32 sums, for every row count. Otherwise on
    CPU runs aten._weight_int8pack_mm for up to PACKED_MAX_ROWS rows; it is only fast with bf16
    activations, so inputs are cast to bf16 and the result back to the caller's dtype. Larger
    inputs (prefill chunks, big decode batches) and other devices: dequantize + matmul. The scales
    are kept in bf16 on every path (the same weights whichever kernel runs)."""

    # Registered buffers (register_buffer in __init__), typed for the checker.
    codes: torch.Tensor
    packed: torch.Tensor
    scales: torch.Tensor

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, matmul: ModuleType | None = None
    ):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.bias = bias
        self._matmul = None if matmul is None else matmul.int8_matmul
        if matmul is None:
            self.register_buffer("codes", codes.contiguous())
            self.register_buffer("scales", scales.to(torch.bfloat16))
        else:
            self.register_buffer("packed", matmul.pack_int8(codes))  # [in, out]
            self.register_buffer("scales", scales.to(torch.bfloat16).float())  # the kernel reads fp32

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, matmul: ModuleType | None = None, amax: torch.Tensor | None = None
    ) -> Int8Linear:
        codes, scales = quantize_int8(linear.weight.detach(), amax)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(codes, scales, bias, matmul)

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.codes if self._matmul is None else self.packed.t(), self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self._matmul is not None:
            return self._matmul(x2, self.packed, self.scales, self.bias).view(*shape[:-1], self.out_features)
        if self.codes.device.type == "cpu" and x2.shape[0] <= PACKED_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.codes, self.scales)
        else:
            dtype = torch.bfloat16 if self.codes.device.type == "cpu" else x.dtype
            y = torch.nn.functional.linear(x2.to(dtype), self.codes.to(dtype) * self.scales.to(dtype)[:, None])
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)
