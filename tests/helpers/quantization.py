"""Quantization references: the block kernels the CPU backend gives quantized layers here, the
activation rounding those kernels multiply by and its tolerances, and engines compared teacher-forced."""

from __future__ import annotations

import torch

from tachyllm.backends import create_backend
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.eval.quality import compare, eval_engine, heldout_windows

# The block kernels the engine's CPU backend would give quantized layers here (None without AVX-512 VNNI).
BLOCK_KERNELS = create_backend("auto", torch.device("cpu")).block_kernels()


def engine_for(path: str | None, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, max_num_seqs=4, max_model_len=256, threads=1, **kwargs))


def teacher_forced_top1(path: str, **kwargs) -> float:
    """Top-1 next-token agreement with the same-dtype unquantized engine on held-out windows."""
    ref = eval_engine(EngineConfig(model=path, threads=1), 64)
    engine = eval_engine(EngineConfig(model=path, threads=1, **kwargs), 64)
    return compare(engine, ref, heldout_windows(ref, 64, 4), ("config", "reference")).top1_agreement


def round_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What the kernels multiply by: per 32-block, s = max|x| / 127 and x ≈ s * q (8 bits), or
    x ≈ s * (q + q2 / 256) with a second int8 for the residual (16 bits)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    v = blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(v).clamp(-127, 127)
    if bits == 16:
        q = q + torch.round((v - q) * 256).clamp(-128, 127) / 256
    return (q.double() * (amax / 127).double()).view(x.shape)


# The integer dot products are exact; what is left is fp32 accumulation (fp32 output) or the final
# rounding to bf16 (8-bit mantissa: ~2^-9 relative per value, ~1.5e-3 over a vector).
EXACT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


# Against the unrounded activations, on Gaussian inputs: 8-bit blocks measure ~5e-3 (llama.cpp's
# Q8_1), 16-bit ~2e-5 (plus the bf16 output rounding).
UNROUNDED_RTOL = {8: 1.5e-2, 16: 1e-4}
