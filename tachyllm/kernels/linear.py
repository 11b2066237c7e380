"""CPU linear layers with weights pre-reordered for oneDNN.

PyTorch's plain bf16 F.linear reaches a fraction of memory bandwidth for the one-token matmuls
of decoding; the same weight reordered once into oneDNN's blocked layout runs those about 2x
faster, and no slower for prefill-sized batches (measured in docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_packing_available(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear in model by a PackedLinear; returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module))
    return len(targets)
