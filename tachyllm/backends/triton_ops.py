"""LayerOps on Triton kernels (kernels/triton/fused_ops.py), for the cuda backend: the same ops and
rounding as the portable ones, one kernel launch each. Importing this module imports triton."""

from __future__ import annotations

import torch

from tachyllm.backends.base import LayerOps
from tachyllm.kernels.triton import fused_ops


class TritonOps(LayerOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused_ops.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_ops.add_rms_norm(x, residual, weight, eps)

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_ops.rotary(positions, q, k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused_ops.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused_ops.gelu_tanh_mul(gate_up)
