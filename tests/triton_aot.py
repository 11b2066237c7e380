"""Compiles the Triton kernels for Hopper (sm_90) without a GPU: triton's code generation and ptxas
catch what the interpreter does not (types of loop-carried values, compile-time constants, the fp8
conversions). Run as a script in a process without TRITON_INTERPRET (tests/test_triton_attention.py
does); prints one line per variant and exits 1 on a failure."""

from __future__ import annotations

import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tachyllm.kernels.triton import paged_attention as pa

HOPPER = GPUTarget("cuda", 90, 32)
POINTER = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16", "e4m3": "*fp8e4nv", "e5m2": "*fp8e5", "int8": "*i8"}


def compile_kernel(kernel, pointers: dict[str, str], floats: tuple[str, ...], consts: dict) -> None:
    """Integer arguments by default; `consts` become compile-time constants (None for absent scales)."""
    signature = {name: "i32" for name in kernel.arg_names}
    signature |= pointers | {name: "fp32" for name in floats} | {name: "constexpr" for name in consts}
    triton.compile(ASTSource(kernel, signature, consts), target=HOPPER)


def attention(dtype: str, cache: str, head_dim: int, group: int, split: bool, one_seq: bool = False) -> None:
    quant = cache in ("e4m3", "e5m2", "int8")
    group_p2 = triton.next_power_of_2(group)
    pointers = {name: POINTER[dtype] for name in ("out", "q")} | {
        name: POINTER[cache] for name in ("k_cache", "v_cache")
    }
    pointers |= {name: "*i32" for name in ("block_tables", "query_start", "seq_lens")}
    pointers |= {name: "*fp32" for name in ("part_acc", "part_ml") + (("k_scale", "v_scale") if quant else ())}
    consts = dict(HEAD_DIM=head_dim, HEAD_P2=triton.next_power_of_2(head_dim), GROUP=group, GROUP_P2=group_p2,
                  BLOCK_Q=max(1, pa.MIN_ROWS // group_p2), BLOCK_N=pa.KEY_TILE, SEGMENT=pa.SEGMENT, QUANT=quant,
                  SPLIT=split, DOT_FP32=dtype == "fp32")  # fmt: skip
    if not quant:
        consts |= {"k_scale": None, "v_scale": None}
    if one_seq:  # triton makes an integer argument equal to 1 a constant
        consts["num_seqs"] = 1
    compile_kernel(pa._attention_kernel, pointers, ("scale_log2",), consts)


def merge(dtype: str, head_dim: int) -> None:
    pointers = {
        "out": POINTER[dtype],
        "part_acc": "*fp32",
        "part_ml": "*fp32",
        "query_start": "*i32",
        "seq_lens": "*i32",
    }
    consts = dict(HEAD_DIM=head_dim, HEAD_P2=triton.next_power_of_2(head_dim), SEGMENT=pa.SEGMENT)
    compile_kernel(pa._merge_kernel, pointers, (), consts)


def write(dtype: str, cache: str, kv_heads: int, head_dim: int) -> None:
    quant, mantissa, min_exp = pa._QUANT.get({"e4m3": pa.torch.float8_e4m3fn, "e5m2": pa.torch.float8_e5m2,
                                              "int8": pa.torch.int8}.get(cache), (0, 0, 0))  # fmt: skip
    pointers = {"k": POINTER[dtype], "v": POINTER[dtype], "k_cache": POINTER[cache], "v_cache": POINTER[cache]}
    pointers |= {"slot_mapping": "*i64"} | ({"k_scale": "*fp32", "v_scale": "*fp32"} if quant else {})
    head_p2, heads_p2 = triton.next_power_of_2(head_dim), triton.next_power_of_2(kv_heads)
    block_t = max(1, pa.WRITE_TILE // (head_p2 * heads_p2))
    consts = dict(HEAD_DIM=head_dim, HEAD_P2=head_p2, HEADS_P2=heads_p2, BLOCK_T=block_t, QUANT=quant,
                  QMAX=127.0 if quant == 1 else 448.0, MANTISSA=mantissa, MIN_EXP=min_exp)  # fmt: skip
    if not quant:
        consts |= {"k_scale": None, "v_scale": None}
    compile_kernel(pa._write_kv_kernel, pointers, (), consts)


VARIANTS = [
    (attention, ("bf16", "bf16", 128, 4, False)),
    (attention, ("bf16", "bf16", 128, 4, True)),
    (attention, ("bf16", "bf16", 64, 3, False, True)),
    (attention, ("fp16", "fp16", 256, 1, True)),
    (attention, ("fp32", "fp32", 80, 2, True)),
    (attention, ("bf16", "e4m3", 128, 8, True)),
    (attention, ("bf16", "e5m2", 64, 2, False)),
    (attention, ("fp16", "int8", 128, 4, True)),
    (merge, ("bf16", 128)),
    (merge, ("fp32", 80)),
    (write, ("bf16", "bf16", 8, 128)),
    (write, ("bf16", "e4m3", 8, 128)),
    (write, ("fp16", "e5m2", 32, 128)),
    (write, ("fp32", "int8", 3, 64)),
]

if __name__ == "__main__":
    failed = 0
    for fn, args in VARIANTS:
        try:
            fn(*args)
            print("ok", fn.__name__, args)
        except Exception:
            failed += 1
            print("FAILED", fn.__name__, args)
            traceback.print_exc()
    sys.exit(1 if failed else 0)
