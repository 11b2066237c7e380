"""The backends by name, and the choice of one at engine start."""

from __future__ import annotations

import logging

import torch

from tachyllm.backends.base import Backend
from tachyllm.errors import ConfigError

logger = logging.getLogger("tachyllm")

_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator: makes the backend selectable as EngineConfig(backend=cls.name)."""
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def resolve_backend_name(requested: str, device: torch.device) -> str:
    """The backend to run: `requested`, or for "auto" the Triton kernels on a CUDA device (when
    triton imports), the C++ kernels where they run (the CPU, when they built), else portable
    PyTorch. ConfigError when the requested one cannot run here."""
    if requested == "auto":
        if device.type == "cuda" and _BACKENDS["cuda"].unavailable_reason(device) is None:
            return "cuda"
        return "cpu" if _BACKENDS["cpu"].unavailable_reason(device) is None else "torch"
    cls = _BACKENDS.get(requested)
    if cls is None:
        raise ConfigError(f"backend must be one of auto, {', '.join(_BACKENDS)}, got {requested!r}")
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise ConfigError(f"backend {requested!r} cannot run here: {reason}; use backend 'auto' or 'torch'")
    return requested


def create_backend(requested: str, device: torch.device) -> Backend:
    """The engine's backend, chosen once; logged."""
    name = resolve_backend_name(requested, device)
    cls = _BACKENDS[name]
    logger.info("backend: %s (%s)%s", name, cls.description, ", chosen by auto" if requested == "auto" else "")
    return cls(device)
