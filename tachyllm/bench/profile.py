"""`tachy bench latency --profile`: where the time of a decode step goes.

One batch is prefilled and run through a few untimed decode steps, then a few more decode steps run
under torch.profiler (CPU activity), with the engine's stage spans (tachyllm/tracing.py) recorded as
`record_function` ranges; nothing in the engine is patched:

    tachy::step            each engine.step() (the driver loop here)
    tachy::schedule        the scheduler deciding the step
    tachy::prepare_inputs  the step's input tensors and attention metadata (the backend's builder)
    tachy::forward         the model's forward (embedding, layers, final norm; not the LM head)
    tachy::attention       each layer's backend attention (inside a fused C++ layer: its attention kernels)
    tachy::sample          sampling, and verification of draft tokens

The step's wall time is then split into categories that add up to it exactly:

    matmul        ops outside the ranges above, other than attention, that are matrix products
                  (linear, mm, addmm, bmm, matmul, oneDNN linear, packed int4/int8 products), LM head included
    attention     the whole attention call: K/V cache write, gather, grouped matmuls, softmax, its Python
    other_ops     the remaining ops of the forward and the logits (norms, rotary, activations, adds, copies)
    python_forward  the forward's time outside any op: Python and dispatch between the ops
    prepare_inputs, sampling, scheduling   the whole range (ops and Python)
    python_other  what is left of the step: output processing, detokenization, engine bookkeeping

An op nested in another op counts once, in its outermost op. Times are those of the profiled steps,
which the profiler itself slows down (each recorded op costs a few microseconds); the same steps'
time without the profiler is reported alongside.

On a CUDA device the profiler also records the device's activity: the kernels (and copies) per step
and their summed duration, next to the step's host-side wall time (the CUDA runtime calls it then
records on the host are not counted as ops). A step whose device time is far
under its wall time is bound by the host (Python, launches), not by the GPU.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from tachyllm import tracing

logger = logging.getLogger("tachyllm")

STEP = "tachy::step"
SCHEDULE = "tachy::schedule"
PREPARE = "tachy::prepare_inputs"
FORWARD = "tachy::forward"
ATTENTION = "tachy::attention"
SAMPLE = "tachy::sample"
RANGES = (STEP, SCHEDULE, PREPARE, FORWARD, ATTENTION, SAMPLE)

# Categories in print order, with their labels; their ms add up to the step's.
CATEGORIES = {
    "matmul": "matmuls (linear, mm, oneDNN, int4/int8 packed, C++ GEMV)",
    "attention": "attention (the backend's, whole call)",
    "other_ops": "other ops (norms, rotary, activations, adds; C++ or ATen)",
    "python_forward": "Python / dispatch in model forward",
    "prepare_inputs": "input preparation (tensors, attention metadata)",
    "sampling": "sampling (and draft verification)",
    "scheduling": "scheduling",
    "python_other": "Python / other (outputs, detokenize, engine)",
}
# Parts of the attention row; not added to the total again.
ATTENTION_PARTS = {
    "matmul": "matmuls",
    "softmax": "softmax",
    "other_ops": "other ops (cache write, gather, copies; C++ decode kernel)",
    "python": "Python / dispatch",
}

MATMUL_OPS = {
    "linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "dot", "einsum", "_addmm_activation",
    "_int_mm", "_weight_int8pack_mm", "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu",
    "_weight_int4pack_mm_with_scales_and_zeros", "_linear_pointwise", "mkldnn_linear", "_mkl_linear",
    "mkldnn_linear_pointwise",
}  # fmt: skip
TOP_OPS = 15
# C++ kernels that count as attention wherever they run (kernels/csrc/attention.cpp).
ATTENTION_KERNELS = {"native::paged_attention", "native::write_kv"}


def is_matmul(op_name: str) -> bool:
    """aten::mm, mkldnn::_linear_pointwise, aten::_weight_int4pack_mm_for_cpu, tachy::*gemv*, ... by the
    name after '::'."""
    base = op_name.rsplit("::", 1)[-1]
    return base in MATMUL_OPS or "pack_mm" in base or base.endswith("_linear") or "gemv" in base


def is_runtime_call(name: str) -> bool:
    """The CUDA runtime and driver calls (cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch, ...)
    and the profiler's own buffer requests that a profile with CUDA activity records on the host:
    not ops. Their time stays in whatever encloses them, as in a profile of the CPU alone."""
    return re.match(r"cu(da)?[A-Z]", name) is not None or name == "Activity Buffer Request"


def is_softmax(op_name: str) -> bool:
    return "softmax" in op_name.rsplit("::", 1)[-1]


@dataclass
class OpStat:
    name: str
    calls_per_step: float
    self_ms_per_step: float
    percent_of_step: float


@dataclass
class StepProfile:
    num_steps: int  # profiled decode steps
    step_ms: float  # mean wall time of a profiled step
    categories_ms: dict[str, float]  # per step; keys of CATEGORIES; they add up to step_ms
    attention_ms: dict[str, float]  # the attention category split into ATTENTION_PARTS
    ops_per_step: float  # every op the profiler saw, nested ones included
    top_level_ops_per_step: float
    top_ops: list[OpStat] = field(default_factory=list)  # by self CPU time
    batch_size: int = 0
    warmup_steps: int = 0
    unprofiled_step_ms: float | None = None  # median wall time of the warm-up decode steps (no profiler)
    device: str = "cpu"
    device_activities_per_step: float | None = None  # CUDA: kernels, copies and sets the profiler saw
    device_ms_per_step: float | None = None  # CUDA: their summed duration (one stream: the GPU's busy time)
    top_device_ops: list[OpStat] = field(default_factory=list)  # CUDA: by summed duration

    def percent(self, ms: float) -> float:
        return 100.0 * ms / self.step_ms if self.step_ms > 0 else 0.0


# -- instrumentation ----------------------------------------------------------------------------

LABELS = {"schedule": SCHEDULE, "prepare_inputs": PREPARE, "forward": FORWARD, "attention": ATTENTION, "sample": SAMPLE}


def instrumented() -> AbstractContextManager:
    """Records the engine's stage spans as profiler ranges until the block ends, however it ends."""
    return tracing.traced(lambda stage: record_function(LABELS[stage]))


# -- the run ------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_decode(engine, prompts: list[list[int]], num_steps: int = 10, warmup_steps: int = 5) -> StepProfile:
    """Prefills `prompts` as one batch, runs `warmup_steps` decode steps, then profiles `num_steps`
    decode steps. The engine must have no other requests; it has none when this returns."""
    from tachyllm.sampling_params import RequestOutputKind, SamplingParams

    if num_steps < 1:
        raise ValueError(f"profile needs at least one decode step, got {num_steps}")
    if engine.has_unfinished_requests():
        raise ValueError("profile_decode needs an idle engine")
    # Enough tokens that no request finishes before the profile ends, even one whose prefill ended
    # a few (chunked-prefill) steps before the others'; whatever is left is aborted at the end.
    budget = max(1, engine.config.max_num_batched_tokens)
    prefill_steps = -(-sum(len(p) for p in prompts) // budget) + 1
    room = engine.max_model_len - max(len(p) for p in prompts)
    if room < 1 + warmup_steps + num_steps:
        raise ValueError(
            f"the profile needs prompt + {1 + warmup_steps + num_steps} tokens within max_model_len "
            f"({engine.max_model_len}): use a shorter --input-len or fewer profile steps"
        )
    max_tokens = min(room, 1 + warmup_steps + num_steps + prefill_steps)
    # Final outputs only, as LLM.generate asks: the steps do the work of an offline batch.
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    ids = [f"profile-{i}" for i in range(len(prompts))]
    device = engine.device
    try:
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params)
        # Until every request has its first token (final outputs only: the engine's own requests tell).
        while engine.has_unfinished_requests() and any(
            rid in engine.requests and engine.requests[rid].seqs[0].num_output_tokens == 0 for rid in ids
        ):
            engine.step()
        warm = []
        for _ in range(warmup_steps):
            _synchronize(device)
            t0 = time.perf_counter()
            engine.step()
            _synchronize(device)
            warm.append(time.perf_counter() - t0)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with instrumented(), profile(activities=activities) as prof:
            for _ in range(num_steps):
                with record_function(STEP):
                    engine.step()
                    _synchronize(device)
        snapshot = engine.snapshot()
        if (left := snapshot.num_running + snapshot.num_waiting) != len(ids):
            logger.warning("profile: %d of %d requests ended early; the batch shrank", len(ids) - left, len(ids))
    finally:
        for rid in ids:
            engine.abort_request(rid)
    result = analyze(prof.events(), num_steps, device_activity=device.type == "cuda")
    result.batch_size = len(prompts)
    result.warmup_steps = warmup_steps
    result.unprofiled_step_ms = statistics.median(warm) * 1e3 if warm else None
    result.device = str(device)
    return result


# -- the analysis -------------------------------------------------------------------------------


def analyze(events, num_steps: int, device_activity: bool = False) -> StepProfile:
    """Splits the time of the tachy::step ranges among CATEGORIES (see the module docstring); with
    `device_activity`, also sums the device's events (each profiled step synchronizes, so every one
    of them belongs to a profiled step)."""
    us = {k: 0.0 for k in CATEGORIES}
    att = {k: 0.0 for k in ATTENTION_PARTS}
    step_us = forward_us = forward_inner_us = 0.0
    attention_in_forward_us = 0.0
    ops = top_level = 0
    self_us: dict[str, float] = {}
    calls: dict[str, int] = {}
    device_us: dict[str, float] = {}
    device_calls: dict[str, int] = {}

    for e in events:
        dur = e.time_range.elapsed_us()
        if e.device_type != DeviceType.CPU:
            if e.name in RANGES:  # our ranges' shadows on the device timeline, not device work
                continue
            device_us[e.name] = device_us.get(e.name, 0.0) + dur
            device_calls[e.name] = device_calls.get(e.name, 0) + 1
            continue
        # The nearest enclosing range of ours, whether an op encloses this event, and the step.
        region, inside_op, in_step, in_forward = None, False, e.name == STEP, False
        parent = e.cpu_parent
        while parent is not None:
            if parent.name in RANGES:
                region = region or parent.name
                in_step = in_step or parent.name == STEP
                in_forward = in_forward or parent.name == FORWARD
            elif region is None:
                inside_op = True  # an op between this event and the nearest range
            parent = parent.cpu_parent
        if not in_step:
            continue
        name = e.name
        if name in RANGES:
            if name == STEP:
                step_us += dur
            elif name == SCHEDULE:
                us["scheduling"] += dur
            elif name == PREPARE:
                us["prepare_inputs"] += dur
            elif name == SAMPLE:
                us["sampling"] += dur
            elif name == FORWARD:
                forward_us += dur
            elif name == ATTENTION:
                us["attention"] += dur
                if in_forward:
                    attention_in_forward_us += dur
            continue
        self_us[name] = self_us.get(name, 0.0) + e.self_cpu_time_total
        calls[name] = calls.get(name, 0) + 1
        if is_runtime_call(name):  # listed with the ops by self time, counted in none of the categories
            continue
        ops += 1
        if inside_op:
            continue
        top_level += 1
        if region in (STEP, FORWARD):
            if name in ATTENTION_KERNELS:  # called by the fused C++ decode layer, not the backend's attention
                us["attention"] += dur
                att["other_ops"] += dur
            else:
                us["matmul" if is_matmul(name) else "other_ops"] += dur
            if region == FORWARD:
                forward_inner_us += dur
        elif region == ATTENTION:
            att["matmul" if is_matmul(name) else "softmax" if is_softmax(name) else "other_ops"] += dur
        # ops inside schedule / prepare / sample are part of those ranges' time already

    us["python_forward"] = max(0.0, forward_us - forward_inner_us - attention_in_forward_us)
    att["python"] = max(0.0, us["attention"] - att["matmul"] - att["softmax"] - att["other_ops"])
    attributed = sum(v for k, v in us.items() if k != "python_other")
    us["python_other"] = max(0.0, step_us - attributed)

    per_step = 1e-3 / num_steps  # us in all -> ms per step
    step_ms = step_us * per_step
    top = sorted(self_us, key=lambda op: self_us[op], reverse=True)[:TOP_OPS]
    top_device = sorted(device_us, key=lambda op: device_us[op], reverse=True)[:TOP_OPS]
    return StepProfile(
        num_steps=num_steps,
        step_ms=step_ms,
        categories_ms={k: v * per_step for k, v in us.items()},
        attention_ms={k: v * per_step for k, v in att.items()},
        ops_per_step=ops / num_steps,
        top_level_ops_per_step=top_level / num_steps,
        top_ops=[
            OpStat(
                n,
                calls[n] / num_steps,
                self_us[n] * per_step,
                100.0 * self_us[n] * per_step / step_ms if step_ms else 0.0,
            )
            for n in top
        ],
        device_activities_per_step=sum(device_calls.values()) / num_steps if device_activity else None,
        device_ms_per_step=sum(device_us.values()) * per_step if device_activity else None,
        top_device_ops=[
            OpStat(n, device_calls[n] / num_steps, device_us[n] * per_step, 100.0 * device_us[n] * per_step / step_ms)
            for n in top_device
            if step_ms
        ],
    )


def format_profile(p: StepProfile) -> str:
    lines = [
        f"Decode-step profile: batch {p.batch_size}, {p.num_steps} steps under torch.profiler"
        + f" after {p.warmup_steps} warm-up steps",
        f"  step {p.step_ms:.2f} ms profiled"
        + (f" ({p.unprofiled_step_ms:.2f} ms without the profiler)" if p.unprofiled_step_ms is not None else "")
        + f"; {p.ops_per_step:.0f} ops per step, {p.top_level_ops_per_step:.0f} outermost",
    ]
    if p.device != "cpu":
        lines.append(f"  note: on {p.device} the op times are CPU-side (launch) times, not kernel times")
    if p.device_ms_per_step is not None:
        lines.append(
            f"  device: {p.device_activities_per_step:.0f} kernels / copies per step, {p.device_ms_per_step:.2f} ms"
            f" per step busy ({p.percent(p.device_ms_per_step):.0f}% of the step's wall time)"
        )
    width = max(len(label) for label in CATEGORIES.values()) + 2
    lines.append(f"  {'where':<{width}} {'ms/step':>9} {'% step':>7}")
    for key, label in CATEGORIES.items():
        ms = p.categories_ms[key]
        lines.append(f"  {label:<{width}} {ms:9.2f} {p.percent(ms):6.1f}%")
        if key == "attention":
            for part, part_label in ATTENTION_PARTS.items():
                ms = p.attention_ms[part]
                lines.append(f"    {part_label:<{width - 2}} {ms:9.2f} {p.percent(ms):6.1f}%")
    lines.append(f"  {'total':<{width}} {p.step_ms:9.2f} {100.0 if p.step_ms else 0.0:6.1f}%")
    name_width = max([len(o.name) for o in p.top_ops] + [len("op")]) + 2
    lines.append(f"  Top {len(p.top_ops)} ops by self CPU time")
    lines.append(f"  {'op':<{name_width}} {'calls/step':>10} {'self ms/step':>12} {'% step':>7}")
    for o in p.top_ops:
        lines.append(
            f"  {o.name:<{name_width}} {o.calls_per_step:10.1f} {o.self_ms_per_step:12.2f} {o.percent_of_step:6.1f}%"
        )
    if p.top_device_ops:
        lines.append(f"  Top {len(p.top_device_ops)} device kernels by time")
        for o in p.top_device_ops:
            lines.append(f"  {o.name[:100]:<{name_width}} {o.calls_per_step:10.1f} {o.self_ms_per_step:12.2f}"
                         f" {o.percent_of_step:6.1f}%")  # fmt: skip
    return "\n".join(lines)
