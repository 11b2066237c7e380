"""Building blocks shared by the decoder-only models: RMSNorm, rotary embedding, gated MLP.

Each runs its elementwise work through the LayerOps it is built with (the backend's `ops`:
portable PyTorch by default, tachyllm's C++ kernels with the cpu backend)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tachyllm.backends.base import PORTABLE_OPS, LayerOps
from tachyllm.errors import ConfigError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps = PORTABLE_OPS):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self._norm, self._add_norm = ops.rms_norm, ops.add_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add fused with the next norm: returns (norm(x + residual), x + residual); may
        update both tensors in place (x is always a fresh layer output)."""
        return self._add_norm(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None, "without rope_scaling the type is the default"
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        # Wavelengths between the two thresholds blend the scaled and unscaled frequencies.
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise ConfigError(f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3")


class RotaryEmbedding:
    """Precomputed cos/sin tables; applied in the half-split (NeoX / HF) layout."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None,
        device,
        dtype,
        ops: LayerOps = PORTABLE_OPS,
    ):
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)
        self._rotate = ops.rotary

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [tokens, heads, head_dim] and k (possibly in place)."""
        return self._rotate(positions, q, k, self.cos, self.sin)


class GatedMLP(nn.Module):
    """Gated feed-forward, act(gate) * up, with gate and up projections fused into one matmul:
    SwiGLU (activation "silu"), or GELU with the tanh approximation (Gemma's "gelu_tanh")."""

    def __init__(self, hidden: int, intermediate: int, ops: LayerOps = PORTABLE_OPS, activation: str = "silu"):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._act_mul = {"silu": ops.silu_mul, "gelu_tanh": ops.gelu_tanh_mul}[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act_mul(self.gate_up_proj(x)))
