"""Execution backends: which kernels run a step (base.py says what a backend provides)."""

from tachyllm.backends import cpu_backend, cuda_backend, torch_backend  # noqa: F401  (registers the built-in backends)
from tachyllm.backends.base import AttentionMetadata, Backend, LayerKV, LayerOps, MetadataBuilder
from tachyllm.backends.registry import backend_names, create_backend, register_backend, resolve_backend_name

__all__ = [
    "AttentionMetadata",
    "Backend",
    "LayerKV",
    "LayerOps",
    "MetadataBuilder",
    "backend_names",
    "create_backend",
    "register_backend",
    "resolve_backend_name",
]
