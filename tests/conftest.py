"""Shared fixtures (tiny random-weight HF models saved to disk, the real default model, clients of a
module's server), and the markers `gpu` and `native` skipping tests this machine cannot run. Helper
functions the test modules share are in tests/helpers/."""

from __future__ import annotations

import os
from pathlib import Path

# Tiny test models gain nothing from a second thread, and OpenMP threads spin badly when another
# process holds a core. Tests that time or exercise the real model pass threads= explicitly.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The checkpoint cache (tachyllm/loading/cache.py) goes to a directory removed after the session,
# never into the user's ~/.cache; set TACHY_CACHE_DIR to keep one between runs (or to off).
if "TACHY_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TACHY_CACHE_DIR"] = tempfile.mkdtemp(prefix="tachy-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TACHY_CACHE_DIR"], ignore_errors=True)

import pytest
import torch
from helpers.models import make_tiny_model

# Triton fixes whether its kernels (and its own library functions) run compiled or interpreted when
# they are defined, for the whole process. Without a GPU the Triton kernels' tests run in its
# interpreter on the CPU (TRITON_INTERPRET=1 before anything imports triton); with one, compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[tuple, Path] = {}

    def factory(arch: str = "llama", tie: bool = False, **overrides) -> Path:
        key = (arch, tie, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tie, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from tachyllm.loading.default_model import default_model_path as path

    return path()


# A server test module defines `url` (its server's base URL); these clients talk to it.
@pytest.fixture(scope="module")
def client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(url: str):
    import httpx

    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


def pytest_collection_modifyitems(config, items) -> None:
    """A test marked `gpu` needs a CUDA device and one marked `native` tachyllm's C++ kernels: where
    the machine lacks one, the test is skipped, saying why."""
    missing: dict[str, str] = {}
    if not torch.cuda.is_available():
        missing["gpu"] = "needs a CUDA device"
    if any(item.get_closest_marker("native") for item in items):
        from tachyllm.kernels.native import native_ops

        if native_ops() is None:
            missing["native"] = "needs tachyllm's C++ kernels: not built here, or turned off (TACHY_NATIVE)"
    for item in items:
        for marker, reason in missing.items():
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))
