"""CPU bf16 linear layers: tachyllm's C++ matrix-vector kernel for few-token inputs (decode),
PyTorch for the rest.

A one-token matmul is a single pass over the weight, so its speed is memory bandwidth. Of the
machine's read bandwidth, PyTorch's plain bf16 F.linear reaches the least, a oneDNN-prepacked
weight more, and kernels/csrc/bf16_gemv.cpp the most, reading PyTorch's own row-major weight. That
kernel needs no packed copy, so each weight is kept once, as it is (a tied LM head keeps sharing
the embedding table). Above NATIVE_MAX_ROWS rows F.linear on that plain weight takes over; a
oneDNN-prepacked copy would be somewhat faster there: the price of keeping one copy
(measurements: docs/design_measurements.md#bf16-linears; `benchmarks/kernels_bench.py bf16`).
The kernel is built for AVX512-BF16 or for AVX2 + FMA. Where oneDNN packs no bf16 (no AVX-512:
AMD Zen 2/3, Intel client cores) PyTorch's bf16 F.linear is slow at every row count (~2.4 GMAC/s
on an AVX2 EPYC; the kernel's AVX2 path ~47 per thread at 128-512 rows, measured on an AVX-512
machine: docs/design_measurements.md#bf16-linears), so there the kernel takes every row
count. Without the C++ kernels, or where the kernel is a scalar loop (neither instruction set),
the weight is prepacked for oneDNN instead, where oneDNN packs bf16; so is every float32 weight.

Batch invariance (docs/determinism.md): a token's output must not depend on how many rows share the
call. The C++ kernel and oneDNN's GEMM each keep that (one fixed summation order per output), except
oneDNN with a single row, which it sums another way: a lone row is computed as two. Between the two
implementations the sums differ, so a deterministic engine (`batch_invariant`, the default) sends
every row count to the C++ kernel.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

# Largest row count (tokens) sent to the C++ kernel when the engine is not batch invariant
# (--no-deterministic). Against F.linear on the same weight, at the default model's shapes with 2
# threads, it is faster up to about 128 rows, 1.1-1.2x slower above (with 1 thread the crossover is
# near 48; measurements: docs/design_measurements.md#bf16-linears).
NATIVE_MAX_ROWS = 128


def onednn_packing_available(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packing_available(dtype: torch.dtype, kernels: ModuleType | None) -> bool:
    """Whether PackedLinear takes linears of this dtype: on the bf16 kernel, or packed for oneDNN."""
    return (dtype == torch.bfloat16 and kernels is not None) or onednn_packing_available(dtype)


class PackedLinear(nn.Module):
    """`kernels`: the backend's bf16 matrix-vector kernel (Backend.bf16_linear_kernels), or None.
    `batch_invariant`: the kernel computes every row count, never F.linear (so it does wherever
    oneDNN cannot pack bf16: F.linear is no faster there)."""

    def __init__(self, linear: nn.Linear, kernels: ModuleType | None = None, batch_invariant: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.ops = kernels if weight.dtype == torch.bfloat16 else None
        every_row = batch_invariant or not onednn_packing_available(torch.bfloat16)
        self.max_kernel_rows = None if every_row else NATIVE_MAX_ROWS
        self.weight: torch.Tensor | None
        self.packed_weight: torch.Tensor | None
        # oneDNN's post-op on the output of a packed weight: "none", or "gelu" (fuse_gelu).
        self.post_op = "none"
        if self.ops is not None:
            self.weight, self.packed_weight = weight, None
        else:
            self.weight, self.packed_weight = None, torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def native_spec(self) -> tuple | None:
        """This layer for the fused C++ decode layer (kernels/csrc/decode_layer.cpp), if it runs the kernel."""
        if self.ops is None:
            return None
        max_rows = -1 if self.max_kernel_rows is None else self.max_kernel_rows
        return (0, self.weight, self.bias, self.out_features, 0, max_rows, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            if x.numel() == self.in_features:  # one row: computed as two (see the module's docstring)
                pair = x.reshape(1, -1).expand(2, -1).contiguous()
                y = torch.ops.mkldnn._linear_pointwise(pair, self.packed_weight, self.bias, self.post_op, [], "none")
                return y[:1].view(*x.shape[:-1], self.out_features)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, self.post_op, [], "none")
        assert self.post_op == "none", "fuse_gelu fuses only into a oneDNN-packed weight"
        assert self.ops is not None and self.weight is not None, "unpacked: the kernel's own weight"
        if self.max_kernel_rows is None or x.numel() <= self.max_kernel_rows * self.in_features:
            return self.ops.bf16_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """self(x) + residual; on a oneDNN-packed weight the sum is the GEMM's own post-op (one pass over
        the output instead of two)."""
        if self.packed_weight is None or self.post_op != "none":
            return self(x) + residual
        if x.numel() == self.in_features:  # one row: computed as two, as forward does
            pair = x.reshape(1, -1).expand(2, -1).contiguous()
            other = residual.reshape(1, -1).expand(2, -1).contiguous()
            y = torch.ops.mkldnn._linear_pointwise.binary(pair, other, self.packed_weight, self.bias, "add")
            return y[:1].view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed_weight, self.bias, "add")


def fuse_gelu(linear: nn.Module) -> bool:
    """Makes a oneDNN-packed linear apply GELU (erf) to its output in the GEMM itself; whether it did (a
    linear of another kind is left as it is, its caller applies GELU)."""
    if not isinstance(linear, PackedLinear) or linear.packed_weight is None:
        return False
    linear.post_op = "gelu"
    return True


def linear_add(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """linear(x) + residual, fused into the GEMM where the linear is packed for oneDNN."""
    if isinstance(linear, PackedLinear):
        return linear.forward_add(x, residual)
    return linear(x) + residual


def pack_linears(model: nn.Module, kernels: ModuleType | None = None, batch_invariant: bool = False) -> int:
    """Replaces every nn.Linear in model by a PackedLinear; returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(module, kernels, batch_invariant))
    return len(targets)
