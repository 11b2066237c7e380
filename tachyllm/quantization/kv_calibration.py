"""Per-(layer, KV head) scales for a quantized KV cache, measured by running the calibration text.

Uncalibrated fp8 caches (scale 1) are a known source of silent accuracy loss; here every scale is
the largest |K| or |V| seen for that head times a headroom margin, divided by the storage maximum.
Values beyond the calibrated range saturate rather than overflow.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tachyllm.backends.base import KVScales
from tachyllm.kernels.kv_quant import qmax
from tachyllm.quantization.calibration import calibration_windows, forward_sequence, scratch_kv_caches
from tachyllm.quantization.model_parts import model_config

logger = logging.getLogger("tachyllm")

KV_CALIB_WINDOWS, KV_CALIB_SEQ_LEN = 4, 256
# fp8 keeps ~2 significant digits at any magnitude, so headroom is nearly free; int8's step grows
# with the scale, so it gets a tighter margin.
MARGIN = {torch.int8: 1.1}
DEFAULT_MARGIN = 2.0


@torch.inference_mode()
def kv_absmax(model: nn.Module, windows: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Largest |K| and |V| per KV head ([kv_heads] each) of every layer over the windows."""
    caches = scratch_kv_caches(model, max(map(len, windows)))
    cfg = model_config(model)
    amax = [(torch.zeros(cfg.num_kv_heads), torch.zeros(cfg.num_kv_heads)) for _ in range(cfg.num_layers)]
    for ids in windows:
        for k, v in caches:
            assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor), "scratch caches are plain"
            k.zero_(), v.zero_()
        forward_sequence(model, ids, caches)
        for (ka, va), (k, v) in zip(amax, caches):
            assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor), "scratch caches are plain"
            torch.maximum(ka, k.float().abs().amax(dim=(0, 1, 3)).cpu(), out=ka)
            torch.maximum(va, v.float().abs().amax(dim=(0, 1, 3)).cpu(), out=va)
    return amax


def kv_cache_scales(model: nn.Module, tokenizer, dtype: torch.dtype) -> KVScales:
    """Per layer (K scale, V scale) [kv_heads, 1] (fp32) for a cache stored as `dtype`, calibrated on
    the shipped text (Backend.allocate_kv_cache takes them)."""
    windows = calibration_windows(model, tokenizer, KV_CALIB_SEQ_LEN, KV_CALIB_WINDOWS)
    amax = kv_absmax(model, windows)
    factor = MARGIN.get(dtype, DEFAULT_MARGIN) / qmax(dtype)
    scales = [((ka.clamp(min=1e-4) * factor).view(-1, 1), (va.clamp(min=1e-4) * factor).view(-1, 1)) for ka, va in amax]
    logger.info(
        "KV cache scales calibrated per layer and KV head on %d tokens (largest |K| %.1f, |V| %.1f)",
        sum(map(len, windows)), max(float(a[0].max()) for a in amax), max(float(a[1].max()) for a in amax),
    )  # fmt: skip
    return scales
