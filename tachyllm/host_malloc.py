"""glibc malloc settings for a process that runs an engine on the CPU.

A decode step allocates and frees the same large tensors every step (logits: [rows, vocabulary]
float32, 67 MB at 64 rows of Gemma 3's 262,144 tokens; the sampler's temporaries; a prefill chunk's
activations). glibc serves every block above its mmap threshold (at most 32 MB by default) with a
fresh mmap and unmaps it on free, so each step faults every page of those tensors in again, and a
thread other than the main one gets its own arenas, whose heaps cannot hold a block over 64 MB at
all. Measured: a 64-row Gemma-3-270M step spent more time in the kernel than in its matrix products
(docs/design_measurements.md#malloc-arena-and-large-blocks). So, as engines that tell their users to preload tcmalloc or
jemalloc get by other means: one arena for every thread, large blocks from the heap, and freed
memory kept for reuse instead of being trimmed, from the moment the engine is built.

A process whose user set malloc's own environment variables, or that runs another C library,
is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger("tachyllm")

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

# Whether keep_freed_memory took effect in this process.
_keeping = False
# Larger than any tensor a step allocates; glibc takes blocks above it from mmap still.
LARGE_BLOCK_LIMIT = 1 << 30
USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        os.confstr("CS_GNU_LIBC_VERSION")  # glibc answers; other C libraries raise
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except (OSError, ValueError):
        return None
    return libc if hasattr(libc, "mallopt") else None


def user_configured_malloc() -> bool:
    return any(name in os.environ for name in USER_SETTINGS) or "malloc" in os.environ.get("GLIBC_TUNABLES", "")


def _set(settings: tuple[tuple[int, int], ...]) -> bool:
    """True when glibc took every setting."""
    libc = _glibc()
    if libc is None or user_configured_malloc():
        return False
    refused = [name for name, value in settings if libc.mallopt(name, value) != 1]
    if refused:
        logger.info("glibc refused mallopt parameters %s: large step tensors may be mapped anew each step", refused)
    return not refused


def use_one_arena() -> bool:
    """Every thread allocates from the main arena, whose heap holds blocks of any size. Call it before
    the thread that will step the engine first allocates: glibc picks a thread's arena then. Best
    effort: glibc honours the limit only while no thread has needed an arena of its own yet, and a
    process whose other threads already have arenas (a Ray worker's) may hand one of those on."""
    return _set(((M_ARENA_MAX, 1),))


def keep_freed_memory() -> bool:
    """From now on large blocks come from the heap and freed memory stays there for reuse. Called once
    the engine is built, so that loading's transient tensors were mapped and returned as usual and the
    process holds what serving needs at its peak, not what loading did."""
    global _keeping
    _keeping = _set(((M_MMAP_THRESHOLD, LARGE_BLOCK_LIMIT), (M_TRIM_THRESHOLD, LARGE_BLOCK_LIMIT)))
    return _keeping


def return_freed_memory() -> bool:
    """Hands the free pages inside malloc's heap back to the kernel (malloc_trim): after freeing many
    blocks at once that the process will not allocate again (weights moved elsewhere). Not once an
    engine of this process keeps freed memory: whatever a later build frees, the serving engine's
    steps would otherwise fault in again."""
    libc = _glibc()
    return libc is not None and not _keeping and not user_configured_malloc() and bool(libc.malloc_trim(0))
