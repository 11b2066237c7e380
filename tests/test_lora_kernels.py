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
        (lambda w: w | {"scale": torch.ones(4)}, "a scale goes with int8 weights only"),
        (lambda w: w | {"a": w["a"].to(torch.int8), "bt": w["bt"].to(torch.int8)}, "need their fp32 scale per rank"),
        (lambda w: w | {"a": w["a"].to(torch.int8), "bt": w["bt"].to(torch.int8), "scale": torch.ones(3)},
         "need their fp32 scale per rank"),
        (lambda w: w | {"a": w["a"].to(torch.int8), "bt": w["bt"].to(torch.int8), "scale": torch.ones(4).double()},
         "need their fp32 scale per rank"),
    ],
)  # fmt: skip
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


def _odd_adapters(weight_dtype: torch.dtype, in_features: int, cols: list[int], ranks: dict[int, int]):
    """LoRASlots with, per slot, one adapter of the given rank on every projection of `cols` columns
    (stored in `weight_dtype`; int8: codes in ±127 with a scale per rank), and each slot's fp64 (A,
    [(first column, Bt [rank, columns])], the scale per rank)."""
    gen = torch.Generator().manual_seed(5)
    slots, reference = ops.LoRASlots(), {}
    for slot, rank in ranks.items():
        ranks_total = rank * len(cols)
        if weight_dtype == torch.int8:
            a = torch.randint(-127, 128, (ranks_total, in_features), generator=gen, dtype=torch.int8)
            bts = [torch.randint(-127, 128, (rank, n), generator=gen, dtype=torch.int8) for n in cols]
            scale = torch.rand(ranks_total, generator=gen) * 1e-3
        else:
            a = torch.randn(ranks_total, in_features, generator=gen).to(weight_dtype)
            bts = [torch.randn(rank, n, generator=gen).to(weight_dtype) for n in cols]
            scale = None
        layout = torch.tensor([[sum(cols[:p]), n, p * rank, rank] for p, n in enumerate(cols)])
        slots.set(slot, a, torch.cat([bt.flatten() for bt in bts]), layout, scale)
        rank_scale = torch.ones(ranks_total, dtype=torch.float64) if scale is None else scale.double()
        reference[slot] = (a.double(), [(sum(cols[:p]), bt.double()) for p, bt in enumerate(bts)], rank_scale)
    return slots, reference


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.int8),
     (torch.float32, torch.int8)],
)  # fmt: skip
def test_kernel_tiles_and_threads_leave_every_output_alone(dtype, weight_dtype):
    """Shapes off every tile of the kernel (input features not a multiple of 16, ranks off the 4- and
    8-rank shrink tiles, segments of 1 to 9 rows off the 4-row tiles, columns off the 16- and 64-column
    expand chunks): each row's output is the fp64 result to fp32 rounding, and the same bits whether
    the row is alone on one thread or among the others on two."""
    in_features, cols = 100, [70, 33]
    slots, reference = _odd_adapters(weight_dtype, in_features, cols, {1: 5, 2: 3, 3: 9})
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
        a, expands, rank_scale = reference[slot_of[row]]
        shrunk = (x[row].double() @ a.T) * rank_scale
        rank = expands[0][1].shape[0]
        for p, (col0, bt) in enumerate(expands):
            want[row, col0 : col0 + bt.shape[1]] += shrunk[p * rank : (p + 1) * rank] @ bt
    # fp32 sums of ~100 terms of up to ~30: a few fp32 ulps of the largest; bf16 output: one bf16 ulp.
    err = (outs[0].double() - want).abs()
    bound = want.abs() * (1e-5 if dtype == torch.float32 else 2**-7) + 1e-4
    assert (err <= bound).all(), f"max error {err.max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", [[(1, 1)], [(1, 3), (0, 2), (3, 1), (2, 4), (1, 1)]])
def test_int8_stored_weights_match_pytorch_path_on_dequantized_weights(dtype, step):
    """lora_dtype int8: A and scale · Bᵀ stored as int8 codes with a scale per row, each rank's two
    scales multiplied into its shrunk sum. The PyTorch path with the dequantized weights in fp32 gives
    the same outputs (to fp32 rounding, or one bf16 ulp), and the int8 adapters' update differs from
    the fp32 adapters' by about the codes' rounding (a percent at most here, in fp32)."""
    int8_path = lora_linear(IN, OUTS, dtype, StepSegments(torch.device("cpu"), ops, dtype, lora_dtype="int8"))
    torch_path = lora_linear(IN, OUTS, dtype, StepSegments(torch.device("cpu")))
    for slot, weights in int8_path.slots.items():
        assert weights.stacked_a.dtype == weights.bt.dtype == torch.int8 and weights.rank_scale is not None
        reference = torch_path.slots[slot]
        fp32_update = (reference.stacked_a.clone(), reference.bt.clone())
        # The codes dequantized: A's scale per row, Bᵀ's per row of each projection's [rank, columns].
        a_scale = reference.stacked_a.abs().amax(dim=1) / 127
        reference.stacked_a.copy_(weights.stacked_a.float() * a_scale[:, None])
        for (_, ranks, bt), (_, _, codes) in zip(reference.expands, weights.expands):
            bt.copy_(codes.float() * (weights.rank_scale[ranks] / a_scale[ranks])[:, None])
        assert (reference.stacked_a - fp32_update[0]).abs().max() <= a_scale.max() / 2 + 1e-7
        assert (reference.bt - fp32_update[1]).abs().max() <= fp32_update[1].abs().max() / 254 + 1e-7
    x = torch.randn(sum(n for _, n in step), IN, generator=torch.Generator().manual_seed(3)).to(dtype)
    for path in (torch_path, int8_path):
        path.segments.set_step(seqs(step))
    want, got = torch_path(x), int8_path(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        _ulp_close(got, want)
    base = int8_path.base(x)
    fp32_path = lora_linear(IN, OUTS, dtype, StepSegments(torch.device("cpu"), ops, dtype, lora_dtype="float32"))
    fp32_path.segments.set_step(seqs(step))
    update, fp32_update_out = (got.float() - base.float()), (fp32_path(x).float() - base.float())
    # bf16 outputs add their own rounding (an ulp of the output, ~0.4%, against the update's ~10% of it).
    bound = 0.01 if dtype == torch.float32 else 0.05
    assert (update - fp32_update_out).norm() <= bound * fp32_update_out.norm()


def test_weight_dtype_follows_the_base_linear_and_lora_dtype():
    """auto: int8 over a quantized base linear (the kernels take it), the activations' rule elsewhere;
    an explicit lora_dtype everywhere; one the kernels or activations cannot run is refused at start."""
    from torch import nn

    from tachyllm.errors import ConfigError
    from tachyllm.quantization.int8 import Int8Linear, quantize_int8

    dense = nn.Linear(IN, 8, bias=False)
    quantized = Int8Linear(*quantize_int8(dense.weight.detach()), None)
    cpu = torch.device("cpu")
    auto = StepSegments(cpu, ops, torch.bfloat16)
    assert auto.weight_dtype_for(quantized) == torch.int8
    assert auto.weight_dtype_for(dense) == torch.bfloat16
    assert StepSegments(cpu, ops, torch.float32).weight_dtype_for(dense) == torch.float32
    assert StepSegments(cpu, None, torch.bfloat16).weight_dtype_for(quantized) == torch.float32  # PyTorch path
    assert StepSegments(cpu, ops, torch.bfloat16, lora_dtype="bfloat16").weight_dtype_for(quantized) == torch.bfloat16
    assert StepSegments(cpu, ops, torch.float32, lora_dtype="int8").weight_dtype_for(dense) == torch.int8
    with pytest.raises(ConfigError, match="lora_dtype int8 needs the CPU backend's LoRA kernels"):
        StepSegments(cpu, None, torch.bfloat16, lora_dtype="int8")
    with pytest.raises(ConfigError, match="lora_dtype bfloat16 needs bf16 activations"):
        StepSegments(cpu, ops, torch.float32, lora_dtype="bfloat16")
