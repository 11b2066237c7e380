"""How the C++ block kernels round activations: --quant-activation-bits, or when it is unset, a
check at load for a GGUF file's blocks.

8 bits per 32 inputs (llama.cpp's rounding) does twice the multiply-adds per instruction of 16 (two
int8 parts), so batched steps and prefill run faster; a decode token costs the same. What it costs
in fidelity depends on the model, not on the format: KL(16-bit || 8-bit) of the next-token
distributions on the shipped calibration text, median of four 128-token windows, is 0.002 for
Qwen2.5-Coder-0.5B, 0.004 for Qwen2.5-Coder-1.5B (both Q4_K_M), 0.005 for SmolLM2-135M Q4_1 and 0.015
for Gemma-3-270M Q4_K_M (docs/quantization.md). So a GGUF file's blocks (gguf: the format llama.cpp's
and vLLM's GGUF kernels run at 8 bits) measure it at load and take 8 bits where it is at most
KL_BOUND, 16 otherwise; the measurement is kept between starts (stored_check_path). int4/awq and
pre-quantized checkpoints keep 16, as their reference kernels (vLLM's W4A16) do.

A tensor-parallel rank keeps 16 unless told: it is built without its collectives (they are added
once every rank has its part), so it cannot run the model alone; run after they were added, two
ranks measured different KLs (0.00023 and 0.00029 on a tiny model's first window), so they could
decide differently. The windows are cut to --max-model-len when it is shorter than 128.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeGuard

import torch
from torch import nn

from tachyllm.kernels import native
from tachyllm.loading.cache import cache_dir, short_digest
from tachyllm.quantization.calibration import (
    calibration_windows,
    forward_sequence,
    next_token_kl,
    scratch_kv_caches,
)
from tachyllm.quantization.gguf_packed import GGUFLinear
from tachyllm.quantization.int4 import ACTIVATION_BITS, Int4Linear
from tachyllm.quantization.model_parts import compute_logits, norm_weight

logger = logging.getLogger("tachyllm")

KL_BOUND = 0.01  # nats per token: between the Qwen and SmolLM2 files' 0.002-0.005 and Gemma-3-270M's 0.015
CHECK_WINDOWS, CHECK_TOKENS = 4, 128


def block_layers(model: nn.Module) -> list[GGUFLinear | Int4Linear]:
    """The layers on the C++ block kernels (int4/awq layers, a GGUF file's blocks): the ones whose
    activations are rounded."""
    return [m for m in model.modules() if _on_blocks(m)]


def _on_blocks(module: nn.Module) -> TypeGuard[GGUFLinear | Int4Linear]:
    return isinstance(module, GGUFLinear) or (isinstance(module, Int4Linear) and module.kernel == "blocks")


def set_activation_bits(model: nn.Module, bits: int) -> int:
    """Sets every block layer's rounding; returns how many there are."""
    layers = block_layers(model)
    for m in layers:
        m.activation_bits = bits
    return len(layers)


def model_activation_bits(model: nn.Module) -> int | None:
    """The model's block layers' rounding, or None without such layers."""
    return next((m.activation_bits for m in block_layers(model)), None)


@dataclass
class ActivationCheck:
    window_kls: list[float]  # each calibration window's mean KL(16-bit || 8-bit) per token, nats
    tokens: int
    seconds: float

    @property
    def kl(self) -> float:
        """The median window's: a few tokens of one window can move a mean far (Qwen2.5-Coder-0.5B: one
        window of four at 0.034, the others 0.002), where a model that 8 bits do not suit is off in
        every window (Gemma-3-270M: 0.011-0.042)."""
        return statistics.median(self.window_kls)

    @property
    def bits(self) -> int:
        return 8 if self.kl <= KL_BOUND else 16


def check_windows(model: nn.Module, tokenizer) -> list[list[int]]:
    """The calibration text's windows the check runs (cut to the model's rotary table, --max-model-len)."""
    return calibration_windows(model, tokenizer, CHECK_TOKENS, CHECK_WINDOWS)


@torch.inference_mode()
def check_8_bits(model: nn.Module, windows: list[list[int]]) -> ActivationCheck:
    """What 8-bit rounding moves the model's next-token distributions on the windows (check_windows),
    each run at 16 and at 8 bits; leaves the model at 16."""
    t0 = time.perf_counter()
    caches = scratch_kv_caches(model, max(map(len, windows)))
    window_kls = []
    for ids in windows:
        logprobs = []
        for bits in (ACTIVATION_BITS, 8):
            set_activation_bits(model, bits)
            hidden = forward_sequence(model, ids, caches)
            logprobs.append(torch.log_softmax(compute_logits(model, hidden[:-1]).float(), dim=-1))
        window_kls.append(float(next_token_kl(*logprobs).mean()))
    set_activation_bits(model, ACTIVATION_BITS)
    return ActivationCheck(window_kls, sum(len(ids) - 1 for ids in windows), time.perf_counter() - t0)


def stored_check_path(source: str, model: nn.Module, windows: list[list[int]]) -> Path | None:
    """Where a file's check is kept between starts (in the checkpoint cache's directory), keyed by all
    that the measurement depends on: the file's identity, the model's dtype, which layers run on blocks
    of which types (--quant-skip), the windows' token ids (--max-model-len cuts them, the tokenizer
    makes them), tachyllm's code and the C++ kernels' build. None with the cache off
    (TACHY_CACHE_DIR=off) or when any of it cannot be read."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        real = os.path.realpath(source)
        stat = os.stat(real)
        code = _code_fingerprint()
    except OSError:
        return None
    blocks = [(name, getattr(m, "block_types", type(m).__name__)) for name, m in model.named_modules() if _on_blocks(m)]
    key = json.dumps(
        {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": str(norm_weight(model).dtype), "blocks": blocks,
         "windows": windows, "code": code},
        sort_keys=True,
    )  # fmt: skip
    # The path's digest groups the entries of one file, so that storing one drops its stale versions.
    return directory / "activation_checks" / f"{short_digest(real)}-{short_digest(key)}.json"


@functools.cache
def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted([*package.rglob("*.py"), *(package / "data").glob("*.txt")]):
        digest.update(path.read_bytes())
    digest.update(native.build_key().encode())
    return digest.hexdigest()


def _load_check(path: Path) -> ActivationCheck | None:
    """A stored check, or None (absent, unreadable or malformed: measured again and rewritten)."""
    try:
        data = json.loads(path.read_text())
        check = ActivationCheck([float(kl) for kl in data["window_kls"]], int(data["tokens"]), float(data["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    valid = len(check.window_kls) == CHECK_WINDOWS and all(math.isfinite(kl) and kl >= 0 for kl in check.window_kls)
    return check if valid and check.tokens > 0 else None


def _store_check(path: Path, check: ActivationCheck) -> None:
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(check), f)
        os.replace(partial, path)  # a concurrent start reads the old entry or this one, never a partial one
        partial = None
        family = path.name.split("-")[0]
        for stale in path.parent.glob(f"{family}-*.json"):
            if stale != path:
                stale.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning(
            "activation check: could not keep it in %s (%s); the next start measures again (TACHY_CACHE_DIR=off: "
            "no cache)", path, exc,
        )  # fmt: skip
    finally:
        if partial is not None:
            Path(partial).unlink(missing_ok=True)


def resolve_activation_bits(
    model: nn.Module, method: str, bits: int | None, tokenizer, sharded: bool, source: str | None = None
) -> None:
    """Sets the block layers' rounding: `bits` if given, else the module docstring's rule; logged.
    `sharded`: `model` is a tensor-parallel rank's. `source`: the model file, whose check is kept
    between starts (stored_check_path)."""
    if bits is not None:
        count = set_activation_bits(model, bits)
        if bits != ACTIVATION_BITS:
            if count:
                logger.info(
                    "quant_activation_bits %d: %d layers round activations to int8 per 32 inputs, as llama.cpp does",
                    bits, count,
                )  # fmt: skip
            else:
                logger.warning("quant_activation_bits %d has no effect: no layer runs the C++ block kernels here", bits)
        return
    count = set_activation_bits(model, ACTIVATION_BITS)
    if method != "gguf" or not count:
        return
    if sharded:
        logger.info("activations rounded to 16 bits: tensor-parallel ranks do not run the 8-bit check")
        return
    windows = check_windows(model, tokenizer)
    stored = stored_check_path(source, model, windows) if source is not None else None
    check = _load_check(stored) if stored is not None else None
    if check is not None:
        when = f"measured in {check.seconds:.1f} s at an earlier start, kept in {stored}"
    else:
        check = check_8_bits(model, windows)
        when = f"checked in {check.seconds:.1f} s"
        if stored is not None:
            _store_check(stored, check)
    set_activation_bits(model, check.bits)
    logger.info(
        "activations rounded to %d bits per 32 inputs in %d layers: 8 bits (llama.cpp's rounding, faster batches) "
        "move the next-token distributions by KL %.4f per token (median of %d calibration windows of %d tokens; "
        "largest %.4f), %s the %.2f bound (%s; --quant-activation-bits 8 or 16 skips the check)",
        check.bits, count, check.kl, len(check.window_kls), check.tokens // len(check.window_kls) + 1,
        max(check.window_kls),
        "within" if check.bits == 8 else "above", KL_BOUND, when,
    )  # fmt: skip
