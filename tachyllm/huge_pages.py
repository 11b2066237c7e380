"""A CPU model's weights on transparent huge pages.

A decode step streams every weight from memory once. On 4 KiB pages the weights of a 1.5B-parameter
model span a quarter of a million pages: each one a TLB miss, and a boundary the hardware prefetchers
stop at. Linux maps 2 MiB at once (transparent huge pages) where the process asks for it under the
common `madvise` setting, and glibc's malloc, which holds PyTorch's CPU tensors, does not ask. So once
a model's weights are final they move, storage by storage, into one anonymous mapping marked
MADV_HUGEPAGE (one mapping: small tensors share huge pages instead of each rounding up to one).
Measured in docs/benchmarks.md ("Huge pages").

Tensors keep their identity (`tensor.data` is replaced), so every holder of a weight sees the move;
call it before anything keeps a weight's address (the backends' fused layers). Where the kernel has no
transparent huge pages (another OS, `never`), nothing moves.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Collection, Iterator
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


def available() -> bool:
    """Transparent huge pages can back a mapping that asks for them."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
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
            if isinstance(value, dict):
                values = value.values()
            elif isinstance(value, (list, tuple)):
                values = value
            else:
                values = (value,)
            yield from (v for v in values if isinstance(v, torch.Tensor))


def _movable(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.untyped_storage().nbytes() >= MIN_STORAGE_BYTES
    )


def move_weights(model: nn.Module, leave: Collection[torch.Tensor] = ()) -> int:
    """Moves `model`'s CPU weight storages, but those of `leave` (tensors a step does not stream),
    onto huge pages; returns the bytes moved (0 where the kernel offers none). Tensors that shared a
    storage still share one."""
    if not available():
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    seen = {id(t) for t in leave}
    left = {t.untyped_storage().data_ptr() for t in leave}
    for tensor in _module_tensors(model):
        if id(tensor) not in seen and _movable(tensor) and tensor.untyped_storage().data_ptr() not in left:
            seen.add(id(tensor))
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    if not by_storage:
        return 0
    sizes = {ptr: group[0].untyped_storage().nbytes() for ptr, group in by_storage.items()}
    total = sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes.values())
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the first write: pages are faulted in as huge pages
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive while a weight uses it
    start = -arena.data_ptr() % HUGE_PAGE
    freed = 0
    for ptr, group in by_storage.items():
        size = sizes[ptr]
        old = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())
        arena[start : start + size].copy_(old)
        for tensor in group:
            offset, itemsize = tensor.storage_offset(), tensor.element_size()
            moved = torch.empty(0, dtype=tensor.dtype).set_(
                arena.untyped_storage(), start // itemsize + offset, tensor.shape, tensor.stride()
            )
            tensor.data = moved
        start += -(-size // ALIGNMENT) * ALIGNMENT
        del old  # the last reference to the old storage
        freed += size
        if freed >= TRIM_EVERY_BYTES:
            # malloc keeps freed blocks inside its heap resident: untrimmed, the process would hold the
            # weights twice by the end.
            return_freed_memory()
            freed = 0
    return_freed_memory()
    logger.info("weights on transparent huge pages: %.1f MiB in %d storages", total / 2**20, len(by_storage))
    return total
