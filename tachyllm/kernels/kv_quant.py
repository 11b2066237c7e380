"""Quantized KV-cache storage: fp8 (e4m3 / e5m2) or int8 with one scale per (layer, KV head).

Values are divided by the scale and rounded when written, multiplied back when read inside
attention. Scales are fixed at engine start from a calibration pass (quantization/kv_calibration.py):
dynamic per-token scales would have to be stored beside the cache and break the clean 2x block count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KV_STORAGE = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}


def qmax(dtype: torch.dtype) -> float:
    return float(torch.iinfo(dtype).max) if dtype == torch.int8 else float(torch.finfo(dtype).max)


@dataclass
class QuantizedKV:
    """One layer's K or V cache: `data` [slots, kv_heads, head_dim] in the storage dtype and a
    per-head `scale` [kv_heads, 1] (fp32) with value ≈ stored * scale. With `block_size`, the C++
    attention kernel reads it in place as [blocks, block_size, kv_heads, head_dim]."""

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int | None = None
    # (paged data, flat scales): made once, as every layer of every step passes them to the kernels.
    _kernel_args: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def paged(self) -> torch.Tensor:
        assert self.block_size is not None, "only a cache made with its block size is read paged"
        return self.data.view(-1, self.block_size, *self.data.shape[1:])

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache, per-head scales) as the C++ kernels take them."""
        if self._kernel_args is None:
            self._kernel_args = self.paged(), self.scale.view(-1)
        return self._kernel_args

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        dtype = self.data.dtype
        limit = qmax(dtype)
        y = (x.float() / self.scale).clamp(-limit, limit)  # saturate values beyond the calibrated range
        if dtype == torch.int8:
            y = y.round()
        # index_copy_ has no CPU kernel for float8: copy the raw bytes instead.
        self.data.view(torch.uint8).index_copy_(0, slots, y.to(dtype).view(torch.uint8))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        stored = self.data.view(torch.uint8)[slots].view(self.data.dtype)
        return (stored.to(torch.float32) * self.scale).to(dtype)


def kv_write(cache: torch.Tensor | QuantizedKV, slots: torch.Tensor, x: torch.Tensor) -> None:
    if isinstance(cache, QuantizedKV):
        cache.write(slots, x)
    else:
        cache.index_copy_(0, slots, x.to(cache.dtype))


def kv_read(cache: torch.Tensor | QuantizedKV, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(cache, QuantizedKV):
        return cache.read(slots, dtype)
    return cache[slots].to(dtype)


def kv_flat(cache: torch.Tensor | QuantizedKV, num_kv_heads: int, head_dim: int) -> torch.Tensor | QuantizedKV:
    """The cache as [slots, kv_heads, head_dim] (QuantizedKV already is)."""
    if isinstance(cache, QuantizedKV):
        return cache
    return cache.view(-1, num_kv_heads, head_dim)
