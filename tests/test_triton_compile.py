"""Every Triton kernel compiled for a GPU that is not here: triton's bundled ptxas turns them into
Hopper (sm_90) binaries on any machine, so a kernel that would not compile on the GPU fails on the
CPU too (the interpreter tests check what they compute, not that they compile). One fresh process
without TRITON_INTERPRET (triton fixes compiled / interpreted per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for module, name, signature, constexprs in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"], name
"""


def _gemms() -> list:
    builds = []
    module = "tachyllm.kernels.triton.quant_matmul"
    for dtype, dot_fp32 in (("bf16", False), ("fp32", True)):  # tensor-core bf16, IEEE fp32
        rows = {"M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32"}
        tiles = {"HAS_BIAS": True, "DOT_FP32": dot_fp32, "BM": 16, "BN": 64, "BK": 32}
        out = {"bias_ptr": f"*{dtype}", "y_ptr": f"*{dtype}"}
        int4 = {"x_ptr": f"*{dtype}", "qw_ptr": "*i32", "s_ptr": "*fp16", "m_ptr": "*fp32", **out, **rows}
        constexprs = dict.fromkeys(["GROUP", *tiles], "constexpr")
        builds.append((module, "_int4_kernel", {**int4, **constexprs}, {"GROUP": 128, **tiles}))
        int8 = {"x_ptr": f"*{dtype}", "qw_ptr": "*i8", "s_ptr": "*fp32", **out, **rows}
        builds.append((module, "_int8_kernel", {**int8, **dict.fromkeys(tiles, "constexpr")}, tiles))
    return builds


def _ops() -> list:
    module, t = "tachyllm.kernels.triton.fused_ops", "*bf16"
    norm = {"x_ptr": t, "r_ptr": t, "w_ptr": t, "out_ptr": t, "sum_ptr": t, "H": "i32", "eps": "fp32"}
    heads = dict.fromkeys(("q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h", "Q_HEADS", "KV_HEADS"), "i32")
    rotary = {"q_ptr": t, "k_ptr": t, "qo_ptr": t, "ko_ptr": t, "pos_ptr": "*i64", "cos_ptr": t, "sin_ptr": t, **heads}
    act = {"x_ptr": t, "out_ptr": t, "INTER": "i32", "GELU": "constexpr", "BLOCK": "constexpr"}
    return [
        (module, "_rms_norm_kernel", {**norm, "ADD": "constexpr", "BLOCK": "constexpr"}, {"ADD": True, "BLOCK": 4096}),
        (module, "_rotary_kernel", {**rotary, **dict.fromkeys(("HALF", "BLOCK", "BLOCK_H"), "constexpr")},
         {"HALF": 64, "BLOCK": 64, "BLOCK_H": 64}),
        (module, "_act_mul_kernel", act, {"GELU": False, "BLOCK": 1024}),
        (module, "_act_mul_kernel", act, {"GELU": True, "BLOCK": 1024}),
    ]  # fmt: skip


@pytest.mark.slow
def test_kernels_compile_for_hopper():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no CUDA backend (ptxas) to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    builds = json.dumps(_gemms() + _ops())
    done = subprocess.run([sys.executable, "-c", _SCRIPT, builds], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
