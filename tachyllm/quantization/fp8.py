"""fp8 weights (`quantization="fp8"`): e4m3 codes with one fp32 scale per output channel, and the
activations quantized per token at run time (dynamic: a row's scale is its amax / 448), multiplied
by torch._scaled_mm with both scales applied to its fp32 sums.

Where it runs: CUDA devices of compute capability 9.0+ (Hopper: fp8 tensor cores; _scaled_mm's
row-wise scaling needs them) and the CPU (torch 2.13's _scaled_mm runs there too, far slower than
the int4 / int8 kernels: it exists so the path is tested without a GPU). Elsewhere quantize_model
refuses it with the reason. A row's scale depends on that row only, but _scaled_mm is not batch
invariant (docs/determinism.md): its CPU kernel gives a row other low bits alone than in a batch
(measured in tests/test_triton_quant.py), and cuBLASLt picks its kernel by shape.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# _scaled_mm on CUDA takes inner and output dimensions that are multiples of 16.
ALIGN = 16


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes e4m3 [out, in], scales fp32 [out]) with weight ≈ codes * scales[:, None] (amax -> 448)."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic quantization of activations [rows, in]: (e4m3 codes, fp32 scales [rows, 1])."""
    xf = x.float()
    scales = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def fp8_unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 weights cannot run on `device`, or None when they can."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= (9, 0):
            return None
        return f"the GPU has compute capability {capability[0]}.{capability[1]}; fp8 needs 9.0 (Hopper) or newer"
    return f"fp8 weights run on CUDA (compute capability 9.0+) and on the CPU, not on {device.type}"


class Fp8Linear(nn.Module):
    # Registered buffers (register_buffer in __init__), typed for the checker.
    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.contiguous())  # [out, in]: .t() is the column-major operand
        self.register_buffer("scales", scales.float().view(1, -1))
        self.bias = bias
        # Row-wise scaled fp8 GEMMs on CUDA write bf16 only; the CPU writes fp32.
        self._out_dtype = torch.bfloat16 if codes.device.type == "cuda" else torch.float32

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        codes, scales = quantize_fp8(linear.weight.detach())
        return cls(codes, scales, None if linear.bias is None else linear.bias.detach())

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scales.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, x_scales = quantize_rows(x.reshape(-1, self.in_features))
        y = torch._scaled_mm(xq, self.codes.t(), scale_a=x_scales, scale_b=self.scales, out_dtype=self._out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*shape[:-1], self.out_features)
