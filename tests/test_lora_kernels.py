"""The LoRA segment kernels: the C++ kernel (kernels/csrc/lora.cpp) that the cpu backend's wrapped
linears run, against their PyTorch path (lora/layers.py), and its bad arguments refused.

Tolerance: both accumulate in fp32 and round the output once; they sum the dot products in different
orders (16 fp32 lanes then the lanes, against oneDNN's blocking), so fp32 outputs agree to a few fp32
ulps of the largest term (rtol 1e-5) and bf16 outputs to one bf16 ulp (a sum that lands on a rounding
boundary may round the other way)."""

from __future__ import annotations

import pytest
import torch
from helpers.lora_kernels import lora_linear, seqs

from tachyllm.kernels import native
from tachyllm.lora.layers import StepSegments

ops = native.native_ops()
pytestmark = [pytest.mark.native, pytest.mark.skipif(ops is None, reason="the C++ kernels did not build")]

IN, OUTS = 96, [64, 32, 32]  # a q/k/v-shaped fused linear


def _pair(dtype: torch.dtype, slots: list[int], seed: int = 0):
    """The same wrapped linear twice, with the PyTorch path and with the kernel, each with its own segments."""
    torch_path = lora_linear(IN, OUTS, dtype, StepSegments(torch.device("cpu")), seed)
    kernel_path = lora_linear(IN, OUTS, dtype, StepSegments(torch.device("cpu"), ops), seed)
    return torch_path, kernel_path


def _ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # one bf16 ulp of the value: 2^-7 relative
        err = (got.float() - want.float()).abs()
        assert (err <= want.float().abs() * 2**-7 + 1e-6).all(), f"max error {err.max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "step",
    [
        [(1, 1)],  # one decode row of one adapter: every row in place, no gather
        [(2, 5)],  # a prefill chunk of one adapter
        [(1, 3), (0, 2), (3, 1), (2, 4), (1, 1)],  # adapters and base rows interleaved
        [(0, 4), (3, 2)],  # slot 3 has weights for q and v only: k's columns stay the base's
    ],
)
def test_kernel_matches_pytorch_path(dtype, step):
    torch_path, kernel_path = _pair(dtype, [1, 2, 3])
    x = torch.randn(sum(n for _, n in step), IN).to(dtype)
    torch_path.segments.set_step(seqs(step))
    kernel_path.segments.set_step(seqs(step))
    want, got = torch_path(x), kernel_path(x)
    _ulp_close(got, want)
    base = torch_path.base(x)
    base_rows = torch.cat([torch.full((n,), slot == 0) for slot, n in step])
    assert torch.equal(got[base_rows], base[base_rows])  # base rows untouched, bit for bit
    assert not torch.equal(got[~base_rows], base[~base_rows])  # the adapters did change their rows


def test_slot_without_weights_in_this_linear_is_skipped():
    """An adapter that targets none of this linear's projections: its rows keep the base output."""
    _, kernel_path = _pair(torch.float32, [1])
    kernel_path.clear_adapter(2)
    kernel_path.segments.set_step(seqs([(2, 3), (1, 2)]))
    x = torch.randn(5, IN)
    got = kernel_path(x)
    base = kernel_path.base(x)
    assert torch.equal(got[:3], base[:3]) and not torch.equal(got[3:], base[3:])


def _weights(rank: int = 4, in_features: int = IN, cols: int = 8):
    """(A, Bt, layout) of one projection over the first `cols` output columns."""
    layout = torch.tensor([[0, cols, 0, rank]])
    return torch.randn(rank, in_features), torch.randn(rank * cols), layout


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w | {"a": w["a"].double()}, "A must be contiguous fp32"),
        (lambda w: w | {"a": w["a"].T}, "A must be contiguous fp32"),
        (lambda w: w | {"bt": w["bt"][:-1]}, "Bt must hold"),
        (lambda w: w | {"bt": w["bt"].view(4, 8)}, "Bt must be contiguous flat"),
        (lambda w: w | {"bt": w["bt"].bfloat16()}, "in A's dtype"),
        (lambda w: w | {"layout": torch.tensor([[0, 8, 1, 4]])}, "ranks exceed A"),
        (lambda w: w | {"layout": torch.tensor([[-1, 8, 0, 4]])}, "columns must be non-negative"),
        (lambda w: w | {"layout": torch.tensor([0, 8, 0, 4])}, "layout is int64"),
        (lambda w: w | {"slot": -1}, "non-negative"),
    ],
)
def test_bad_adapter_weights_refused(change, message):
    a, bt, layout = _weights()
    args = {"slot": 1, "a": a, "bt": bt, "layout": layout}
    ops.LoRASlots().set(**args)  # the unchanged arguments are taken
    with pytest.raises(RuntimeError, match=message):
        ops.LoRASlots().set(**change(args))


@pytest.mark.parametrize(
    "rows, offsets, slots, message",
    [
        (torch.tensor([0, 2]), [0, 3], [1], "offsets must end at the number of rows"),
        (torch.tensor([0, 1], dtype=torch.int32), [0, 2], [1], "rows must be contiguous int64"),
        (None, [0, 1, 2], [1, 2], "without rows, one segment holds every row"),
        (torch.tensor([0, 1]), [0, 2], [1, 2], "offsets must be one more than slots"),
        (torch.tensor([0, 1]), [0, 2, 1], [1, 2], "ascending"),
    ],
)
def test_bad_steps_refused(rows, offsets, slots, message):
    with pytest.raises(RuntimeError, match=message):
        ops.LoRAStep().set(rows, offsets, slots)


@pytest.mark.parametrize(
    "x, out, rows, message",
    [
        (torch.randn(2, IN), torch.zeros(2, 8), torch.tensor([0, 5]), "row index is out of range"),
        (torch.randn(2, IN).half(), torch.zeros(2, 8).half(), torch.tensor([0, 1]), "bf16 or fp32"),
        (torch.randn(2, IN).double(), torch.zeros(2, 8), torch.tensor([0, 1]), "one dtype"),
        (torch.randn(2, IN + 1), torch.zeros(2, 8), torch.tensor([0, 1]), "input features"),
        (torch.randn(2, IN), torch.zeros(2, 6), torch.tensor([0, 1]), "columns exceed out"),
    ],
)
def test_bad_apply_refused(x, out, rows, message):
    slots, step = ops.LoRASlots(), ops.LoRAStep()
    slots.set(1, *_weights())
    step.set(rows, [0, 2], [1])
    with pytest.raises(RuntimeError, match=message):
        slots.apply(out, x, step)


@pytest.mark.parametrize(
    "step",
    [[(1, 1)], [(2, 5)], [(1, 3), (0, 2), (3, 1), (2, 4), (1, 1)], [(1, 6), (2, 5)]],
)
def test_bf16_stored_weights_match_pytorch_path_on_rounded_weights(step):
    """On bf16 activations the kernel's adapters are stored bf16: the PyTorch path with the same
    bf16-rounded weights in fp32 math gives the same outputs to one bf16 ulp (the summation order)."""
    torch_path = lora_linear(IN, OUTS, torch.bfloat16, StepSegments(torch.device("cpu")))
    kernel_path = lora_linear(IN, OUTS, torch.bfloat16, StepSegments(torch.device("cpu"), ops, torch.bfloat16))
    for slot, weights in kernel_path.slots.items():
        assert weights.stacked_a.dtype == weights.bt.dtype == torch.bfloat16
        reference = torch_path.slots[slot]  # fp32, rounded as the kernel's were (views of bt follow)
        reference.stacked_a.copy_(reference.stacked_a.bfloat16().float())
        reference.bt.copy_(reference.bt.bfloat16().float())
        assert torch.equal(reference.bt, weights.bt.float())
    x = torch.randn(sum(n for _, n in step), IN).to(torch.bfloat16)
    torch_path.segments.set_step(seqs(step))
    kernel_path.segments.set_step(seqs(step))
    want, got = torch_path(x), kernel_path(x)
    _ulp_close(got, want)
    # The kernel's bf16 weights against the same weights in fp32: the same fp32 math, one ulp apart at most.
    fp32_path = lora_linear(IN, OUTS, torch.bfloat16, StepSegments(torch.device("cpu"), ops))
    for slot, weights in fp32_path.slots.items():
        weights.stacked_a.copy_(weights.stacked_a.bfloat16().float())
        weights.bt.copy_(weights.bt.bfloat16().float())
        fp32_path.native.set(slot, weights.stacked_a, weights.bt, weights.layout)
    fp32_path.segments.set_step(seqs(step))
    assert torch.equal(kernel_path(x), fp32_path(x))


def test_fp32_activations_keep_fp32_weights():
    linear = lora_linear(IN, OUTS, torch.float32, StepSegments(torch.device("cpu"), ops, torch.float32))
    assert all(w.stacked_a.dtype == w.bt.dtype == torch.float32 for w in linear.slots.values())


def test_bf16_weights_refused_on_fp32_activations():
    a, bt, layout = _weights()
    slots, step = ops.LoRASlots(), ops.LoRAStep()
    slots.set(1, a.bfloat16(), bt.bfloat16(), layout)
    step.set(None, [0, 2], [1])
    with pytest.raises(RuntimeError, match="bf16 adapter weights need bf16 activations"):
        slots.apply(torch.zeros(2, 8), torch.randn(2, IN), step)


def _odd_adapters(dtype: torch.dtype, in_features: int, cols: list[int], ranks: dict[int, int]):
    """LoRASlots with, per slot, one adapter of the given rank on every projection of `cols` columns
    (stored in `dtype`), and each slot's fp64 (A, [(first column, Bt [rank, columns])])."""
    gen = torch.Generator().manual_seed(5)
    slots, reference = ops.LoRASlots(), {}
    for slot, rank in ranks.items():
        a = torch.randn(rank * len(cols), in_features, generator=gen).to(dtype)
        bts = [torch.randn(rank, n, generator=gen).to(dtype) for n in cols]
        layout = torch.tensor([[sum(cols[:p]), n, p * rank, rank] for p, n in enumerate(cols)])
        slots.set(slot, a, torch.cat([bt.flatten() for bt in bts]), layout)
        reference[slot] = (a.double(), [(sum(cols[:p]), bt.double()) for p, bt in enumerate(bts)])
    return slots, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_tiles_and_threads_leave_every_output_alone(dtype):
    """Shapes off every tile of the kernel (input features not a multiple of 16, ranks off the 4- and
    8-rank shrink tiles, segments of 1 to 9 rows off the 4-row tiles, columns off the 16- and 64-column
    expand chunks): each row's output is the fp64 result to fp32 rounding, and the same bits whether
    the row is alone on one thread or among the others on two."""
    in_features, cols = 100, [70, 33]
    slots, reference = _odd_adapters(dtype, in_features, cols, {1: 5, 2: 3, 3: 9})
    sizes = [(1, 9), (2, 1), (3, 6), (2, 2), (1, 3)]  # (slot, rows): slots 1 and 2 twice, grouped apart
    order = list(range(sum(n for _, n in sizes)))
    slot_of = [slot for slot, n in sizes for _ in range(n)]
    grouped = sorted(order, key=lambda r: slot_of[r])
    distinct = sorted(set(slot_of))
    offsets = [0] + [sum(slot_of.count(s) for s in distinct[: i + 1]) for i in range(len(distinct))]
    x = torch.randn(len(order), in_features).to(dtype)
    base = torch.randn(len(order), sum(cols)).to(dtype)
    step = ops.LoRAStep()
    step.set(torch.tensor(grouped), offsets, distinct)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(base.clone())
            slots.apply(outs[-1], x, step)
        torch.set_num_threads(1)
        for row in order:
            alone = base[row : row + 1].clone()
            step.set(None, [0, 1], [slot_of[row]])
            slots.apply(alone, x[row : row + 1], step)
            assert torch.equal(alone[0], outs[0][row]) and torch.equal(alone[0], outs[1][row]), row
    finally:
        torch.set_num_threads(threads)
    want = base.double()
    for row in order:
        a, expands = reference[slot_of[row]]
        shrunk = x[row].double() @ a.T
        rank = expands[0][1].shape[0]
        for p, (col0, bt) in enumerate(expands):
            want[row, col0 : col0 + bt.shape[1]] += shrunk[p * rank : (p + 1) * rank] @ bt
    # fp32 sums of ~100 terms of up to ~30: a few fp32 ulps of the largest; bf16 output: one bf16 ulp.
    err = (outs[0].double() - want).abs()
    bound = want.abs() * (1e-5 if dtype == torch.float32 else 2**-7) + 1e-4
    assert (err <= bound).all(), f"max error {err.max()}"
