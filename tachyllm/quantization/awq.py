"""Activation-aware int4 (AWQ): scale salient input channels up before rounding.

Channels that see large activations matter most for a layer's output. Multiplying weight column j
by s_j before quantization (and the input x_j by 1/s_j at run time) shrinks their relative
rounding error. s = mean|x|^alpha with alpha searched per layer on calibration activations to
minimise the output error; alpha = 0 is plain round-to-nearest, so the search never does worse on
the calibration set. The 1/s is applied inside Int4Linear rather than folded into the previous
RMSNorm / projection: one elementwise multiply per linear, but works for every layer kind.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from tachyllm.quantization.calibration import forward_sequence, scratch_kv_caches
from tachyllm.quantization.int4 import Int4Linear, quantize_int4

ALPHA_GRID = tuple(i / 10 for i in range(11))
MAX_ROWS = 256  # calibration tokens kept per layer: enough for stable channel means, cheap to search


@torch.inference_mode()
def collect_inputs(model: nn.Module, names: list[str], windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Runs the calibration windows once and returns each named linear's inputs, fp32 [rows, in_features].

    Every `stride`-th token is kept so that all layers together stay within a few hundred MiB."""
    stride = max(1, sum(map(len, windows)) // MAX_ROWS)
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = [
        model.get_submodule(n).register_forward_pre_hook(
            lambda _m, args, n=n: seen[n].append(args[0][::stride].float())
        )
        for n in names
    ]
    try:
        caches = scratch_kv_caches(model, max(map(len, windows)))
        for ids in windows:
            forward_sequence(model, ids, caches)
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(xs) for n, xs in seen.items()}


def output_error(weight: torch.Tensor, x: torch.Tensor, group_size: int, scale: torch.Tensor | None) -> float:
    """Mean squared difference between x @ W.T and the int4 layer's output (scale None = plain RTN)."""
    if scale is None:
        w_q = quantize_int4(weight, group_size).dequantize()
    else:
        w_q = quantize_int4(weight * scale, group_size).dequantize() / scale
    return float((x @ (w_q - weight).t()).pow(2).mean())


def search_scale(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> tuple[torch.Tensor | None, float, float]:
    """Best per-input-channel scale for weight given calibration inputs x.

    Returns (scale or None when plain rounding is best, plain error, best error)."""
    w = weight.float()
    importance = x.abs().mean(dim=0).clamp(min=1e-6)
    plain = output_error(w, x, group_size, None)
    best_scale, best_err = None, plain
    for alpha in ALPHA_GRID[1:]:
        s = importance.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre around 1 so neither end under/overflows bf16
        err = output_error(w, x, group_size, s)
        if err < best_err:
            best_scale, best_err = s, err
    return best_scale, plain, best_err


def awq_linear(
    linear: nn.Linear,
    x: torch.Tensor,
    group_size: int,
    kernels: ModuleType | None = None,
    matmul: ModuleType | None = None,
) -> tuple[Int4Linear, float, float]:
    scale, plain, best = search_scale(linear.weight.detach(), x, group_size)
    bias = None if linear.bias is None else linear.bias.detach()
    w = linear.weight.detach().float()
    if scale is None:
        return Int4Linear(quantize_int4(w, group_size), bias, kernels=kernels, matmul=matmul), plain, best
    weight = quantize_int4(w * scale, group_size)
    return Int4Linear(weight, bias, input_scale=1 / scale, kernels=kernels, matmul=matmul), plain, best
