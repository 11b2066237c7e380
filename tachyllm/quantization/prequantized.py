"""Pre-quantized checkpoints (AWQ, GPTQ, compressed-tensors) on the packed kernels, without re-rounding.

A checkpoint linear is w = s * (q - z) per (row, group) (loading/hf_quantized.py). 4-bit: that is
Int4Weight's w = d * q + m with d = s and m = -s * z; a group of 64 / 128 is 2 / 4 blocks of 32
sharing (d, m), so the C++ Q4_1 kernel runs it. The codes and s are kept exactly (s is the file's
fp16); m = -s * z needs up to 15 significant bits and the kernel's block stores it in fp16, so an
asymmetric group's min can move by at most 2^-11 of itself (< 0.75% of one step: 15 s * 2^-11);
symmetric formats (z = 2^(b-1)) are exact. 8-bit with z = 128 (symmetric): q - 128 is an int8 code
and s its scale, exactly the Q8_0 block kernel. Asymmetric 8-bit (a per-group min the Q8_0 block
has no room for), group sizes that are not a multiple of 32, and 8-bit without the C++ kernels are
dequantized to the model dtype (logged).

Act-order (GPTQ desc_act / compressed-tensors actorder=group: a column's group is g_idx[j], not
j // group_size): the input columns are sorted by group so that groups are contiguous, and the
layer gathers its activations in that order (PermutedInput); the product is the same sum.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from tachyllm.loading.hf_quantized import PackedLinear, PrequantizedWeights
from tachyllm.quantization.gguf_packed import GGUFLinear, q8_0_matrix
from tachyllm.quantization.int4 import BLOCK, GROUP_SIZES, Int4Linear, Int4Weight

logger = logging.getLogger("tachyllm")


class PermutedInput(nn.Module):
    """A linear whose weight columns were reordered by `perm`: y = inner(x[..., perm])."""

    perm: torch.Tensor  # a registered buffer

    def __init__(self, inner: nn.Module, perm: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.register_buffer("perm", perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))


@dataclass
class Built:
    module: nn.Module | None  # None: keep the (dequantized) nn.Linear
    why: str = ""  # why it stayed dense
    # Largest weight change, in quantization steps, from the kernel block's fp16 scale and min.
    fp16_rounding: float = 0.0


def act_order(parts: list[PackedLinear]) -> tuple[torch.Tensor | None, str]:
    """The input permutation that makes every part's groups contiguous (None: already are), or an
    explanation when the parts disagree or a group is not `group_size` columns."""
    perms = []
    for p in parts:
        k, g = p.codes.shape[1], p.group_size
        perm = torch.argsort(p.g_idx, stable=True)
        if not torch.equal(p.g_idx[perm], torch.arange(k) // g):
            return None, "act-order groups of unequal size"
        perms.append(perm)
    if any(not torch.equal(perm, perms[0]) for perm in perms[1:]):
        return None, "fused parts with different act-order permutations"
    identity = torch.equal(perms[0], torch.arange(len(perms[0])))
    return (None if identity else perms[0]), ""


def build(
    parts: list[PackedLinear],
    bias: torch.Tensor | None,
    kernels: ModuleType | None,
    device: torch.device = torch.device("cpu"),
    matmul: ModuleType | None = None,
) -> Built:
    """The packed module, on `device`, for one model linear made of `parts` (read on the CPU) stacked
    along the output (fused qkv / gate_up). `matmul`: the backend's quantized matmul kernels, which
    4-bit layers run on where given (codes, scales and mins exact)."""
    bits = {p.bits for p in parts}
    group = min(p.group_size for p in parts)
    if len(bits) > 1:
        return Built(None, "fused parts of different widths")
    if any(p.group_size % BLOCK for p in parts):
        return Built(None, f"group size {group} is not a multiple of {BLOCK}")
    perm, why = act_order(parts)
    if why:
        return Built(None, why)
    # Columns sorted by group; then group j covers columns [j g, (j + 1) g).
    ordered = [_permuted(p, perm) for p in parts]
    if bits == {4}:
        block = next(b for b in reversed(GROUP_SIZES) if all(p.group_size % b == 0 for p in ordered))
        weight = Int4Weight.concat([_int4(p, block) for p in ordered])
        # The backend's matmul kernels, else the device decides Int4Linear's layout (C++ blocks / aten
        # on the CPU, dequantize elsewhere).
        codes, scales, mins = (t.to(device) for t in (weight.codes, weight.scales, weight.mins))
        on_device = Int4Weight(codes, scales, mins, block)
        int4 = Int4Linear(on_device, bias, kernels=kernels if device.type == "cpu" else None, matmul=matmul)
        module: nn.Module = int4
        rounding = _fp16_rounding(weight.scales, 15, weight.mins) if int4.kernel == "blocks" else 0.0
    else:
        if any(bool((p.zeros != 128).any()) for p in ordered):
            return Built(None, "8-bit with zero points (the Q8_0 kernel has no min term)")
        if kernels is None or device.type != "cpu":
            return Built(None, "8-bit needs the C++ Q8_0 kernel (backend cpu)")
        codes = torch.cat([(p.codes - 128).to(torch.int8) for p in ordered])
        scales = torch.cat([p.scales.repeat_interleave(p.group_size // BLOCK, dim=1) for p in ordered])
        module, rounding = GGUFLinear([q8_0_matrix(codes, scales)], kernels, bias), _fp16_rounding(scales, 128)
    return Built(module if perm is None else PermutedInput(module, perm.to(device)), fp16_rounding=rounding)


def _fp16_rounding(d: torch.Tensor, max_code: int, m: torch.Tensor | None = None) -> float:
    """Largest |w' - w| / d when a block's d (and m) are stored in fp16 (the C++ blocks' format)."""
    change = (d.half().float() - d).abs() * max_code
    if m is not None:
        change = change + (m.half().float() - m).abs()
    return float((change / d.abs().clamp(min=1e-30)).max())


def _permuted(p: PackedLinear, perm: torch.Tensor | None) -> PackedLinear:
    if perm is None:
        return p
    k = p.codes.shape[1]
    return PackedLinear(p.codes[:, perm], p.scales, p.zeros, torch.arange(k) // p.group_size, p.bits)


def _int4(p: PackedLinear, block: int) -> Int4Weight:
    """Groups of the checkpoint as Int4Weight groups of `block` (a divisor of them: same scale and min)."""
    repeat = p.group_size // block
    scales = p.scales.repeat_interleave(repeat, dim=1)
    mins = -(p.scales * p.zeros.float()).repeat_interleave(repeat, dim=1)  # exact in fp32: s has 11 bits, z 4
    return Int4Weight(p.codes.to(torch.uint8), scales, mins, block)


def read_parts(weights: PrequantizedWeights, keys: list[str]) -> list[PackedLinear] | None:
    """The packed checkpoint linears for these module names, or None if any is stored dense."""
    if not all(k in weights.modules for k in keys):
        return None
    return [weights.read(k) for k in keys]
