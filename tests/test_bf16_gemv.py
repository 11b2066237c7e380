"""The C++ bf16 matrix-vector kernel (kernels/csrc/bf16_gemv.cpp) against an fp32 reference, and
PackedLinear's kernel path against PyTorch's.

The kernel built here is the AVX-512 BF16 path or the AVX2 + FMA one (`ops.bf16_linear_isa`); on an
AVX-512 machine the AVX2 path is tested by building the kernels for Haswell:
`TACHY_NATIVE_MARCH=haswell pytest tests/test_bf16_gemv.py tests/test_batch_invariance.py -k bf16`."""

from __future__ import annotations

import pytest
import torch

from tachyllm.kernels import native
from tachyllm.kernels.linear import NATIVE_MAX_ROWS, PackedLinear, onednn_packing_available

ops = native.native_ops()
pytestmark = pytest.mark.native


def _reference(x, w, bias=None):
    y = x.float() @ w.float().T
    return y if bias is None else y + bias.float()


def _check(got, x, w, bias=None):
    # fp32 sums in another order, then one rounding to bf16 (relative error <= 2^-9).
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], w.shape[0])
    torch.testing.assert_close(got.float(), _reference(x, w, bias), rtol=1 / 128, atol=1e-3)


# 224 = 7 * 32; 100, 33, 8 and 1 end in a masked (AVX-512) or zero-filled (AVX2) load.
@pytest.mark.parametrize("in_features", [576, 1536, 224, 100, 33, 8, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_fp32_reference(in_features, with_bias):
    torch.manual_seed(in_features)
    for out_features in (37, 131):  # blocks of 4 rows plus 1 or 3 leftover rows
        w = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
        for rows in (1, 2, 5, 9, 33, 130):  # 130 rows of 1,536 inputs: several chunks of tokens
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            _check(ops.bf16_linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("in_features", [576, 45])
def test_rounding_is_torchs_nearest_even(in_features):
    """Small integers sum exactly in any order, so the kernel's bf16 outputs must equal, to the
    bit, torch's rounding of the exact fp32 result (nearest even: ties such as 257 -> 256 and
    259 -> 260 included; bias added before rounding). inf and NaN inputs give inf and NaN as in fp32."""
    torch.manual_seed(5)
    w = torch.randint(-8, 9, (37, in_features)).to(torch.bfloat16)
    x = torch.randint(-8, 9, (11, in_features)).to(torch.bfloat16)
    for bias in (None, torch.randint(-64, 64, (37,)).float() / 2, torch.randint(-64, 64, (37,)).to(torch.bfloat16)):
        expected = _reference(x, w, bias).to(torch.bfloat16)
        assert torch.equal(ops.bf16_linear(x, w, bias).view(torch.int16), expected.view(torch.int16))
    x[3, 0], x[7, 1] = float("inf"), float("nan")
    got = ops.bf16_linear(x, w).float()
    expected = _reference(x, w)
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isinf(), expected.isinf())
    assert got[3].isinf().any() and got[7].isnan().all()


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


@pytest.mark.skipif(not (ops and ops.bf16_linear_vectorized), reason="the engine does not use the scalar kernel")
def test_packed_linear_kernel_path_matches_pytorch():
    """PackedLinear on the kernel against oneDNN's packed weight, or F.linear where oneDNN cannot
    pack bf16 (no AVX-512); the kernel keeps every row count there."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(576, 131).to(torch.bfloat16)
    fast = PackedLinear(linear, ops)
    assert fast.packed_weight is None
    assert fast.weight.data_ptr() == linear.weight.data_ptr()  # no copy: a tied LM head stays tied
    if onednn_packing_available(torch.bfloat16):
        reference = PackedLinear(linear)  # no kernels: oneDNN's packed weight
        assert reference.weight is None and reference.packed_weight is not None
        assert fast.max_kernel_rows == NATIVE_MAX_ROWS
    else:
        reference = linear
        assert fast.max_kernel_rows is None
    with torch.inference_mode():
        # The last runs F.linear where oneDNN packs bf16.
        for shape in [(1, 576), (5, 576), (2, 3, 576), (NATIVE_MAX_ROWS + 1, 576)]:
            x = torch.randn(shape, dtype=torch.bfloat16)
            got, expected = fast(x), reference(x)
            assert got.shape == expected.shape == (*shape[:-1], 131)
            torch.testing.assert_close(got.float(), expected.float(), rtol=1 / 64, atol=2e-2)
