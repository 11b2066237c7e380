"""The C++ bf16 matrix-vector kernel (kernels/csrc/bf16_gemv.cpp) against an fp32 reference, and
PackedLinear's kernel path against its oneDNN path."""

from __future__ import annotations

import pytest
import torch

from tachyllm.kernels import native
from tachyllm.kernels.linear import NATIVE_MAX_ROWS, PackedLinear, onednn_packing_available

ops = native.native_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="C++ kernels could not be built here")


def _reference(x, w, bias=None):
    y = x.float() @ w.float().T
    return y if bias is None else y + bias.float()


def _check(got, x, w, bias=None):
    # fp32 sums in another order, then one rounding to bf16 (relative error <= 2^-9).
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], w.shape[0])
    torch.testing.assert_close(got.float(), _reference(x, w, bias), rtol=1 / 128, atol=1e-3)


@pytest.mark.parametrize("in_features", [576, 1536, 224, 100, 33])  # 224 = 7 * 32; 100 and 33 end in a masked load
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_fp32_reference(in_features, with_bias):
    torch.manual_seed(in_features)
    for out_features in (37, 131):  # blocks of 4 rows plus 1 or 3 leftover rows
        w = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
        for rows in (1, 2, 5, 9, 33):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            _check(ops.bf16_linear(x, w, bias), x, w, bias)


def test_strided_rows_fp32_bias_and_empty_input():
    torch.manual_seed(1)
    wide_w = torch.randn(19, 200, dtype=torch.bfloat16)
    wide_x = torch.randn(7, 300, dtype=torch.bfloat16)
    w, x = wide_w[:, :160], wide_x[:, 40:200]  # rows contiguous, row strides 200 and 300
    bias = torch.randn(19)
    _check(ops.bf16_linear(x, w, bias), x, w, bias)
    assert ops.bf16_linear(x[:0], w).shape == (0, 19)
    # Any leading shape, any strides: [2, 3, in] -> [2, 3, out]; a transposed x is copied.
    x3 = torch.randn(2, 3, 160, dtype=torch.bfloat16)
    torch.testing.assert_close(ops.bf16_linear(x3, w).reshape(6, 19), ops.bf16_linear(x3.reshape(6, 160), w))
    xt = torch.randn(160, 4, dtype=torch.bfloat16).T
    _check(ops.bf16_linear(xt, w), xt, w)


def test_bad_inputs_raise():
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.bf16_linear(torch.randn(2, 64), w)
    with pytest.raises(RuntimeError, match="features"):
        ops.bf16_linear(torch.randn(2, 32, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.bf16_linear(torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(64, 8, dtype=torch.bfloat16).T)
    with pytest.raises(RuntimeError, match="bias"):
        ops.bf16_linear(torch.randn(2, 64, dtype=torch.bfloat16), w, torch.randn(7, dtype=torch.bfloat16))


@pytest.mark.skipif(not onednn_packing_available(torch.bfloat16), reason="oneDNN bf16 unavailable")
@pytest.mark.skipif(not (ops and ops.bf16_linear_vectorized), reason="PackedLinear uses it only with AVX512-BF16")
def test_packed_linear_kernel_path_matches_onednn_path():
    torch.manual_seed(2)
    linear = torch.nn.Linear(576, 131).to(torch.bfloat16)
    fast = PackedLinear(linear, ops)
    assert fast.packed_weight is None
    assert fast.weight.data_ptr() == linear.weight.data_ptr()  # no copy: a tied LM head stays tied
    onednn = PackedLinear(linear)  # no kernels: oneDNN's packed weight
    assert onednn.weight is None and onednn.packed_weight is not None
    with torch.inference_mode():
        for shape in [(1, 576), (5, 576), (2, 3, 576), (NATIVE_MAX_ROWS + 1, 576)]:  # the last runs F.linear
            x = torch.randn(shape, dtype=torch.bfloat16)
            got, expected = fast(x), onednn(x)
            assert got.shape == expected.shape == (*shape[:-1], 131)
            torch.testing.assert_close(got.float(), expected.float(), rtol=1 / 64, atol=2e-2)
