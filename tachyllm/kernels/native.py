"""tachyllm's C++ CPU kernels (kernels/csrc): built with the machine's compiler on first use,
kept on disk, and loaded in a few milliseconds afterwards.

Eager PyTorch spends most of a small decode step in per-op dispatch (~1,700 ATen ops per step for
the default model); these kernels fuse each layer's norms, rotary, paged decode attention and
activation into single calls, and add quantized matrix-vector products that read GGUF-style
blocks at memory speed. The cpu backend (backends/cpu_backend.py) runs them; when the build fails
(no compiler), off the CPU, or with TACHY_NATIVE=0, the engine runs the portable torch backend.

Build directory: $TACHY_NATIVE_DIR, else <XDG cache>/tachyllm/native/<key>, where the key covers
the sources, the torch version, the flags and the CPU, so a stale or foreign build is never loaded.
$TACHY_NATIVE_MARCH replaces the compiler's `-march=native`: `haswell` (AVX2 + FMA, no AVX-512)
builds and tests on an AVX-512 machine the kernels' paths for CPUs without it.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("tachyllm")

MODULE_NAME = "tachyllm_native"
SOURCE_DIR = Path(__file__).parent / "csrc"
_OFF = {"off", "0", "false", "no", "none", "disable", "disabled"}


def cflags() -> list[str]:
    march = os.environ.get("TACHY_NATIVE_MARCH", "").strip() or "native"
    return ["-O3", f"-march={march}", "-fopenmp", "-fno-math-errno", "-std=c++17"]


def _sources() -> list[Path]:
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h"))


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    h = hashlib.sha256()
    for path in _sources():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for part in (torch.__version__, sys.version, " ".join(cflags()), _cpu_signature()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    explicit = os.environ.get("TACHY_NATIVE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser() / build_key()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "tachyllm" / "native" / build_key()


def enabled() -> bool:
    return os.environ.get("TACHY_NATIVE", "").strip().lower() not in _OFF


def _import_built(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    assert spec is not None, "a spec with its loader given"
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build(verbose: bool = False) -> ModuleType:
    """Compiles the kernels (about a minute on 2 cores) unless this exact build exists."""
    directory = build_dir()
    built = directory / f"{MODULE_NAME}.so"
    if built.exists():
        return _import_built(built)
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    logger.info("building tachyllm's C++ kernels in %s (once per machine and version)", directory)
    # The ninja that pip installed beside this interpreter, even when its venv is not activated.
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        return cpp_extension.load(
            name=MODULE_NAME,
            sources=[str(p) for p in _sources() if p.suffix == ".cpp"],
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=verbose,
        )
    finally:
        os.environ["PATH"] = path


@cache
def native_ops() -> ModuleType | None:
    """The compiled kernels, or None (disabled, or the build failed: logged once)."""
    if not enabled():
        return None
    try:
        return build()
    except Exception as exc:  # a missing compiler or headers must not stop the engine
        message = str(exc).strip().splitlines()
        logger.warning("C++ kernels unavailable, using PyTorch ops (slower): %s", message[-1] if message else exc)
        return None


def bind_team_threads(cpus: list[int]) -> list[int]:
    """Pins thread t >= 1 of the calling thread's OpenMP team to cpus[t] (platform.compute_thread_cpus);
    the CPU each team thread now has, -1 where none was set. Nothing without the C++ kernels."""
    ops = native_ops() if cpus else None
    return list(ops.bind_team_threads(cpus)) if ops is not None else []
