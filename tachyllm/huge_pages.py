"""A CPU model's weights on transparent huge pages.

A decode step streams every weight from memory once. On 4 KiB pages the weights of a 1.5B-parameter
model span a quarter of a million pages: each one a TLB miss, and a boundary the hardware prefetchers
stop at. Linux maps 2 MiB at once (transparent huge pages) where the process asks for it under the
common `madvise` setting, and glibc's malloc, which holds PyTorch's CPU tensors, does not ask. So once
a model's weights are final they move, storage by storage, into one anonymous mapping marked
MADV_HUGEPAGE (one mapping: small tensors share huge pages instead of each rounding up to one).
Measured in docs/design_measurements.md#huge-pages.

Tensors keep their identity (`tensor.data` is replaced), so every holder of the tensor objects the
modules hold sees the move; call it before anything keeps a weight's address (the backends' fused
layers). A tensor made from a weight elsewhere (a view's base) keeps the old memory alive beside the
moved copy. Nothing moves where the kernel has no transparent huge pages (another OS, `never`), with
TACHY_HUGE_PAGES=0 (faulting in fresh huge pages is slow on some virtual machines: a start then takes
longer), or when the mapping cannot be made.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from tachyllm.host_malloc import return_freed_memory

logger = logging.getLogger("tachyllm")

HUGE_PAGE = 2 << 20
# Smaller storages (norm weights, biases) are not worth a copy.
MIN_STORAGE_BYTES = 64 << 10
# Each storage starts on a cache line, which every dtype's alignment divides.
ALIGNMENT = 64
TRIM_EVERY_BYTES = 64 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_OFF = {"0", "off", "false", "no"}


def available() -> bool:
    """Transparent huge pages can back a mapping that asks for them, and the user did not say no."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("TACHY_HUGE_PAGES", "").lower() in _OFF:
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def _module_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a module of `model` holds: parameters, buffers and plain attributes (packed
    weights some layers keep outside both), also inside a list, tuple or dict attribute."""
    for module in model.modules():
        for value in vars(module).values():
            values: Iterable[object]
            if isinstance(value, dict):
                values = value.values()
            elif isinstance(value, (list, tuple)):
                values = value
            else:
                values = (value,)
            yield from (v for v in values if isinstance(v, torch.Tensor))


def _movable(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu" and tensor.layout == torch.strided and type(tensor) in (torch.Tensor, nn.Parameter)
    )


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def move_weights(model: nn.Module, leave: Collection[torch.Tensor] = ()) -> int:
    """Moves `model`'s CPU weight storages, but those of `leave` (tensors a step does not stream),
    onto huge pages; returns the bytes moved (0 where the kernel offers none). Tensors that shared a
    storage still share one."""
    left = {_storage_key(t) for t in leave}
    unique = {id(t): t for t in _module_tensors(model)}.values()
    return move_tensors(
        [t for t in unique if _movable(t) and t.untyped_storage().nbytes() >= MIN_STORAGE_BYTES
         and _storage_key(t) not in left],
        "weights", trim=True,
    )  # fmt: skip


def move_tensors(tensors: Iterable[torch.Tensor], what: str, trim: bool = False) -> int:
    """Moves the storages of `tensors` (CPU, strided, plain tensors or parameters) into one mapping
    on huge pages; returns the bytes moved (0 where the kernel offers none). Each tensor keeps its
    identity; tensors that shared a storage still share one (pass every view of a storage: one left
    out keeps the old memory). `trim`: hand the freed heap back to the kernel as storages move (before
    an engine serves, see return_freed_memory)."""
    if not available():
        return 0
    # Keyed by address and size: two storages may start at one address (views of one numpy buffer).
    by_storage: dict[tuple[int, int], list[torch.Tensor]] = {}
    for tensor in tensors:
        assert _movable(tensor), "a CPU tensor or parameter, strided"
        by_storage.setdefault(_storage_key(tensor), []).append(tensor)
    if not by_storage:
        return 0
    total = sum(-(-size // ALIGNMENT) * ALIGNMENT for _, size in by_storage)
    try:
        # 2 MiB of slack: only whole 2 MiB-aligned ranges of a mapping get huge pages.
        region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first write: pages are faulted in as huge pages
    except OSError as exc:  # e.g. strict overcommit: the tensors stay where they are
        logger.info("%s left on 4 KiB pages: no huge-page mapping of %d MiB (%s)", what, total >> 20, exc)
        return 0
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while a tensor uses it
    began = time.perf_counter()
    start = -arena.data_ptr() % HUGE_PAGE
    freed = 0
    for (_, size), group in by_storage.items():
        old = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())
        arena[start : start + size].copy_(old)
        for tensor in group:
            offset, itemsize = tensor.storage_offset(), tensor.element_size()
            moved = torch.empty(0, dtype=tensor.dtype).set_(
                arena.untyped_storage(), start // itemsize + offset, tensor.shape, tensor.stride()
            )
            tensor.data = moved
        start += -(-size // ALIGNMENT) * ALIGNMENT
        del old  # frees the old storage unless something outside the tensors still holds it
        freed += size
        if trim and freed >= TRIM_EVERY_BYTES:
            # malloc keeps freed blocks inside its heap resident: untrimmed, the process would hold the
            # weights twice by the end.
            return_freed_memory()
            freed = 0
    if trim:
        return_freed_memory()
    logger.info(
        "%s on transparent huge pages: %.1f MiB in %d storages (%.1f s)",
        what, total / 2**20, len(by_storage), time.perf_counter() - began,
    )  # fmt: skip
    return total
