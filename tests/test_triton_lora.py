"""The Triton LoRA shrink / expand kernels (kernels/triton/lora.py) on the CPU through Triton's
interpreter, against the same products in PyTorch: fixed-size banks, a slot per row (-1: a base row,
left as it is), q/k/v columns expanded from their own ranks, rows independent of their batch; the
cuda backend's LoRAStep / LoRASlots over them (kernels/triton/lora_buffers.py) in a wrapped linear
against its PyTorch path and the C++ kernel, their buffers' fixed addresses and their bad arguments
refused; and the engine on the cuda backend against the merged weights.

Tolerance: fp32 accumulation in another summation order than PyTorch's (rtol 1e-5); bf16 outputs
within two bf16 ulps (the interpreter's bf16 conversion truncates, tests/test_triton_ops.py)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import assert_all_free
from helpers.lora_files import ALL_TARGETS, merge_adapter, write_adapter
from helpers.lora_kernels import lora_linear, seqs

from tachyllm import LLM, SamplingParams
from tachyllm.kernels import native
from tachyllm.kernels.triton import lora_buffers
from tachyllm.kernels.triton.lora import lora_expand, lora_shrink
from tachyllm.lora.layers import StepSegments
from tachyllm.lora.request import LoRARequest

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IN, OUTS, MAX_RANK, SLOTS = 80, [48, 16, 16], 16, 3
# Per slot: rank and the projections (of q, k, v) it targets.
ADAPTERS = [(16, (0, 1, 2)), (4, (0, 2)), (8, (1,))]


def _banks(seed: int = 0):
    """Banks of SLOTS adapters, and each slot's dense per-projection (A, scale · B) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    a_bank = torch.zeros(SLOTS, len(OUTS) * MAX_RANK, IN)
    bt_bank = torch.zeros(SLOTS, MAX_RANK, sum(OUTS))
    dense = []
    for slot, (rank, targets) in enumerate(ADAPTERS):
        pieces, col = {}, 0
        for p, size in enumerate(OUTS):
            if p in targets:
                a, b = torch.randn(rank, IN, generator=gen) * 0.3, torch.randn(size, rank, generator=gen) * 0.3
                a_bank[slot, p * MAX_RANK : p * MAX_RANK + rank] = a
                bt_bank[slot, :rank, col : col + size] = b.T
                pieces[p] = (a, b, col)
            col += size
        dense.append(pieces)
    return a_bank.to(DEVICE), bt_bank.to(DEVICE), dense


def _reference(x: torch.Tensor, out: torch.Tensor, row_slots: list[int], dense) -> torch.Tensor:
    want = out.clone()
    for t, slot in enumerate(row_slots):
        if slot < 0:
            continue
        for a, b, col in dense[slot].values():
            delta = (x[t].double() @ a.double().T) @ b.double().T
            want[t, col : col + b.shape[0]] = (out[t, col : col + b.shape[0]].double() + delta).to(out.dtype)
    return want


def _run(x: torch.Tensor, out: torch.Tensor, row_slots: list[int], a_bank, bt_bank) -> torch.Tensor:
    slots = torch.tensor(row_slots, dtype=torch.int32, device=DEVICE)
    shrunk = torch.zeros(x.shape[0], a_bank.shape[1], device=DEVICE)
    lora_shrink(x, a_bank, slots, shrunk)
    result = out.clone()
    lora_expand(result, shrunk, bt_bank, slots, bounds=(OUTS[0], OUTS[0] + OUTS[1]))
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_expand_match_pytorch(dtype):
    a_bank, bt_bank, dense = _banks()
    row_slots = [0, -1, 1, 2, 0, -1, 1]
    x = torch.randn(len(row_slots), IN).to(DEVICE, dtype)
    out = torch.randn(len(row_slots), sum(OUTS)).to(DEVICE, dtype)
    got, want = _run(x, out, row_slots, a_bank, bt_bank), _reference(x, out, row_slots, dense)
    base_rows = torch.tensor([s < 0 for s in row_slots])
    assert torch.equal(got[base_rows], out[base_rows])  # base rows untouched
    # slot 2 targets k only: its q and v columns stay the base's
    assert torch.equal(got[3, : OUTS[0]], out[3, : OUTS[0]])
    rtol = 1e-5 if dtype == torch.float32 else 2**-6
    err = (got.float() - want.float()).abs()
    assert (err <= rtol * (want.float().abs() + 1)).all(), f"max error {err.max()}"
    assert not torch.equal(got[~base_rows], out[~base_rows])


def test_rows_independent_of_batch():
    """A row's result alone and among others, in any order: the same bits."""
    a_bank, bt_bank, _ = _banks()
    x, out = torch.randn(6, IN, device=DEVICE), torch.randn(6, sum(OUTS), device=DEVICE)
    row_slots = [1, 0, -1, 2, 0, 1]
    together = _run(x, out, row_slots, a_bank, bt_bank)
    for t in range(6):
        alone = _run(x[t : t + 1], out[t : t + 1], row_slots[t : t + 1], a_bank, bt_bank)
        assert torch.equal(alone[0], together[t])


def test_bad_buffers_refused():
    a_bank, bt_bank, _ = _banks()
    x, out = torch.randn(2, IN, device=DEVICE), torch.randn(2, sum(OUTS), device=DEVICE)
    shrunk = torch.zeros(2, a_bank.shape[1], device=DEVICE)
    with pytest.raises(AssertionError):
        lora_shrink(x, a_bank, torch.tensor([0, 1], device=DEVICE), shrunk)  # int64 slots
    with pytest.raises(AssertionError):
        lora_shrink(x[:, :-1], a_bank, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), shrunk)
    with pytest.raises(AssertionError):
        lora_expand(out, shrunk, bt_bank[:, :12], torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), (48, 64))


# -- the cuda backend's LoRAStep / LoRASlots (kernels/triton/lora_buffers.py) -----------------------
# A q/k/v-shaped wrapped linear with the adapters of helpers/lora_kernels.py (ranks 8, 4 and 16; slot
# 3 targets q and v only), on the Triton kernels and on the PyTorch path; banks for 3 slots of rank 16.
LIN_IN, LIN_OUTS, STEP_ROWS = 48, [32, 16, 16], 32
E2E_GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
MIXED_STEP = [(1, 3), (0, 2), (3, 1), (2, 4), (1, 1), (0, 1)]  # 3 adapters and base rows interleaved


def _triton_segments(dtype: torch.dtype = torch.float32, num_slots: int = 3) -> StepSegments:
    return StepSegments(DEVICE, lora_buffers, dtype, max_tokens=STEP_ROWS, max_rank=16, num_slots=num_slots)


def _triton_and_torch(dtype: torch.dtype, seed: int = 0, num_slots: int = 3):
    """The same wrapped linear on the Triton kernels (on DEVICE) and on the PyTorch path (on the CPU);
    on bf16, the PyTorch path's adapter weights rounded to bf16 as the Triton banks store them."""
    triton_path = lora_linear(LIN_IN, LIN_OUTS, dtype, _triton_segments(dtype, num_slots), seed).to(DEVICE)
    torch_path = lora_linear(LIN_IN, LIN_OUTS, dtype, StepSegments(torch.device("cpu")), seed)
    if dtype == torch.bfloat16:
        assert triton_path.native.a_bank.dtype == torch.bfloat16
        for weights in torch_path.slots.values():  # the expands' Bᵀ are views of bt: rounded with it
            weights.stacked_a.copy_(weights.stacked_a.bfloat16().float())
            weights.bt.copy_(weights.bt.bfloat16().float())
    return triton_path, torch_path


def _step_outputs(triton_path, torch_path, step, dtype):
    x = torch.randn(sum(n for _, n in step), LIN_IN).to(dtype)
    triton_path.segments.set_step(seqs(step))
    torch_path.segments.set_step(seqs(step))
    return triton_path(x.to(DEVICE)).cpu(), torch_path(x), torch_path.base(x)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32: another summation order; bf16: two bf16 ulps (the interpreter's conversion truncates).
    rtol = 1e-5 if want.dtype == torch.float32 else 2**-6
    err = (got.float() - want.float()).abs()
    assert (err <= rtol * (want.float().abs() + 1)).all(), f"max error {err.max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", [MIXED_STEP, [(2, 5)], [(3, 1)], [(0, 3)]])
def test_lora_slots_apply_matches_pytorch_path(dtype, step):
    triton_path, torch_path = _triton_and_torch(dtype)
    got, want, base = _step_outputs(triton_path, torch_path, step, dtype)
    _assert_close(got, want)
    base_rows = torch.cat([torch.full((n,), slot == 0) for slot, n in step])
    assert torch.equal(got[base_rows], base[base_rows])  # base rows untouched, bit for bit
    if not base_rows.all():
        assert not torch.equal(got[~base_rows], base[~base_rows])  # the adapters did change their rows
    slot3_rows = torch.cat([torch.full((n,), slot == 3) for slot, n in step])
    k_columns = slice(LIN_OUTS[0], LIN_OUTS[0] + LIN_OUTS[1])
    assert torch.equal(got[slot3_rows, k_columns], base[slot3_rows, k_columns])  # slot 3 has no k weights


@pytest.mark.native
@pytest.mark.skipif(native.native_ops() is None, reason="the C++ kernels did not build")
def test_lora_slots_apply_matches_the_cpu_kernel():
    triton_path = lora_linear(LIN_IN, LIN_OUTS, torch.float32, _triton_segments()).to(DEVICE)
    cpu_segments = StepSegments(torch.device("cpu"), native.native_ops())
    cpu_path = lora_linear(LIN_IN, LIN_OUTS, torch.float32, cpu_segments)
    got, want, base = _step_outputs(triton_path, cpu_path, MIXED_STEP, torch.float32)
    _assert_close(got, want)
    assert not torch.equal(got, base)


def test_lora_slots_cleared_and_reloaded():
    """Slot 2 cleared: its rows keep the base output; reloaded with another adapter (rank 2, q and k
    only): its rows run that one, and the other slots are as they were."""
    triton_path, torch_path = _triton_and_torch(torch.float32)
    for linear in (triton_path, torch_path):
        linear.clear_adapter(2)
    got, want, base = _step_outputs(triton_path, torch_path, MIXED_STEP, torch.float32)
    slot2_rows = torch.cat([torch.full((n,), slot == 2) for slot, n in MIXED_STEP])
    assert torch.equal(got[slot2_rows], base[slot2_rows])
    _assert_close(got, want)
    gen = torch.Generator().manual_seed(7)
    pieces = {p: (torch.randn(2, LIN_IN, generator=gen), torch.randn(n, 2, generator=gen))
              for p, n in zip(("q_proj", "k_proj"), LIN_OUTS)}  # fmt: skip
    for linear in (triton_path, torch_path):
        linear.set_adapter(2, pieces, 0.5)
    got, want, base = _step_outputs(triton_path, torch_path, MIXED_STEP, torch.float32)
    _assert_close(got, want)
    v_columns = slice(LIN_OUTS[0] + LIN_OUTS[1], None)
    assert torch.equal(got[slot2_rows, v_columns], base[slot2_rows, v_columns])
    assert not torch.equal(got[slot2_rows], base[slot2_rows])


def test_lora_slots_beyond_num_slots_grow_the_banks():
    """More adapters loaded than the banks were sized for (the manager keeps every adapter of the
    unfinished requests loaded): the banks grow, and every slot still runs its adapter."""
    triton_path, torch_path = _triton_and_torch(torch.float32, num_slots=1)
    assert triton_path.native.a_bank.shape[0] == 4  # slots 1-3 of helpers/lora_kernels.py, past 1 + 1
    got, want, _ = _step_outputs(triton_path, torch_path, MIXED_STEP, torch.float32)
    _assert_close(got, want)


def test_lora_step_buffers_keep_their_addresses():
    """The step's slot index is rewritten in place whatever the step's adapters (a CUDA graph reads
    its address): every row's slot, -1 for base rows and for the rows past the step."""
    segments = _triton_segments()
    step = segments.native
    addresses = (step.row_slots.data_ptr(), step.shrunk.data_ptr())
    for mix, want in [
        (MIXED_STEP, [1, 1, 1, -1, -1, 3, 2, 2, 2, 2, 1, -1]),
        ([(2, 4)], [2, 2, 2, 2]),  # one adapter: every row in place
        ([(0, 2), (3, 1)], [-1, -1, 3]),
        ([(0, 5)], []),  # the base model alone
    ]:
        segments.set_step(seqs(mix))
        assert (step.row_slots.data_ptr(), step.shrunk.data_ptr()) == addresses
        expected = torch.full((STEP_ROWS,), -1, dtype=torch.int32)
        expected[: len(want)] = torch.tensor(want, dtype=torch.int32)
        assert torch.equal(step.row_slots.cpu(), expected), mix
    linear = lora_linear(LIN_IN, LIN_OUTS, torch.float32, segments)
    banks = (linear.native.a_bank.data_ptr(), linear.native.bt_bank.data_ptr())
    linear.clear_adapter(1)
    linear.set_adapter(1, {"q_proj": (torch.randn(4, LIN_IN), torch.randn(LIN_OUTS[0], 4))}, 1.0)
    assert (linear.native.a_bank.data_ptr(), linear.native.bt_bank.data_ptr()) == banks


def test_fixed_size_kernels_need_their_sizes():
    with pytest.raises(ValueError, match="max_tokens"):
        StepSegments(DEVICE, lora_buffers, torch.float32)
    with pytest.raises(ValueError, match="max_rank"):
        StepSegments(DEVICE, lora_buffers, torch.float32, max_tokens=8)


@pytest.mark.parametrize(
    "rows, offsets, slots, message",
    [
        (torch.tensor([0, 2]), [0, 3], [1], "offsets must end at the number of rows"),
        (torch.tensor([0, 1], dtype=torch.int32), [0, 2], [1], "rows must be int64"),
        (None, [0, 1, 2], [1, 2], "without rows, one segment holds every row"),
        (torch.tensor([0, 1]), [0, 2], [1, 2], "offsets must be one more than slots"),
        (torch.tensor([0, 1]), [0, 2, 1], [1, 2], "ascending"),
        (torch.tensor([0, STEP_ROWS]), [0, 2], [1], "out of range"),
        (None, [0, STEP_ROWS + 1], [1], "out of range"),
        (torch.tensor([0, 1]), [0, 2], [-1], "non-negative"),
    ],
)
def test_bad_steps_refused(rows, offsets, slots, message):
    step = lora_buffers.LoRAStep(STEP_ROWS, 16, DEVICE)
    with pytest.raises(ValueError, match=message):
        step.set(rows, offsets, slots)


def _one_projection(rank: int = 4) -> dict:
    """set()'s arguments for an adapter of q alone, in slot 1."""
    cols = LIN_OUTS[0]
    a, bt = torch.randn(rank, LIN_IN, device=DEVICE), torch.randn(rank * cols, device=DEVICE)
    return {"slot": 1, "a": a, "bt": bt, "layout": torch.tensor([[0, cols, 0, rank]])}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w | {"a": w["a"].double()}, "fp32 or bf16"),
        (lambda w: w | {"bt": w["bt"][:-1]}, "Bt must hold"),
        (lambda w: w | {"bt": w["bt"].bfloat16()}, "in A's dtype"),
        (lambda w: w | {"layout": torch.tensor([[0, LIN_OUTS[0], 1, 4]])}, "exceed A"),
        (lambda w: w | {"layout": torch.tensor([[8, LIN_OUTS[0], 0, 4]])}, "not one projection"),
        (lambda w: w | {"layout": torch.tensor([0, LIN_OUTS[0], 0, 4])}, "int64"),
        (lambda w: w | {"slot": -1}, "non-negative"),
        (lambda w: _one_projection(rank=32) | {"layout": torch.tensor([[0, LIN_OUTS[0], 0, 32]])}, "exceed"),
    ],
)
def test_bad_adapter_weights_refused(change, message):
    slots = lora_buffers.LoRASlots(LIN_IN, LIN_OUTS, 16, 3, torch.float32, DEVICE)
    args = _one_projection()
    slots.set(**args)  # the unchanged arguments are taken
    with pytest.raises(ValueError, match=message):
        slots.set(**change(args))
    with pytest.raises(ValueError, match="input features"):
        slots.set(2, torch.randn(4, LIN_IN + 1, device=DEVICE), args["bt"], args["layout"])


def test_bad_apply_refused():
    slots, step = (
        lora_buffers.LoRASlots(LIN_IN, LIN_OUTS, 16, 3, torch.float32, DEVICE),
        lora_buffers.LoRAStep(4, 16, DEVICE),
    )
    slots.set(**_one_projection())
    step.set(None, [0, 2], [1])
    with pytest.raises(ValueError, match="expected"):
        slots.apply(torch.zeros(2, 8, device=DEVICE), torch.randn(2, LIN_IN, device=DEVICE), step)
    with pytest.raises(ValueError, match="exceeds the 4"):
        slots.apply(torch.zeros(5, sum(LIN_OUTS), device=DEVICE), torch.randn(5, LIN_IN, device=DEVICE), step)


def test_engine_on_the_cuda_backend_runs_adapters_as_merged_weights(tiny_model_factory, tmp_path, monkeypatch):
    """The cuda backend's engine (the interpreter on the CPU) with two adapters and the base model in one
    batch: each row's fp32 greedy tokens are the model's with that adapter merged into its weights,
    and the adapters ran on the Triton kernels."""
    base = tiny_model_factory()
    adapters = {
        "all": write_adapter(tmp_path / "all", base, ALL_TARGETS, rank=8, alpha=4, use_rslora=True, seed=2),
        "qv": write_adapter(tmp_path / "qv", base, ["q_proj", "v_proj"], rank=4, alpha=8, seed=1),
    }
    options = dict(dtype="float32", device=str(DEVICE), backend="cuda", block_size=4, kv_cache_memory=1 << 20,
                   max_model_len=64)  # fmt: skip
    shrinks = []
    monkeypatch.setattr(lora_buffers, "lora_shrink", lambda *args: shrinks.append(1) or lora_shrink(*args))
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **options)
    assert isinstance(llm.engine.lora.segments.native, lora_buffers.LoRAStep)
    requests = [None] + [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())]
    prompt = [5, 17, 42, 99, 120, 7]
    outputs = llm.generate([prompt] * len(requests), E2E_GREEDY, use_tqdm=False, lora_request=requests)
    got = [o.outputs[0].token_ids for o in outputs]
    assert shrinks, "the adapters ran on the Triton kernels"
    for request, tokens in zip(requests, got):
        name = "base" if request is None else request.lora_name
        merged = base if request is None else merge_adapter(base, adapters[name], tmp_path / name / "merged")
        reference = LLM(str(merged), **options).generate([prompt], E2E_GREEDY, use_tqdm=False)
        assert tokens == reference[0].outputs[0].token_ids, request
    assert got[1] != got[0] and got[2] != got[0]  # the adapters change the output: the check means something
    assert_all_free(llm)
