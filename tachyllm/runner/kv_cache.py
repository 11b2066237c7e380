"""Sizing the paged KV cache: bytes per block and the default memory budget. The backend
allocates it (Backend.allocate_kv_cache)."""

from __future__ import annotations

import torch

from tachyllm.config import ModelConfig

# Default share of free memory for the cache when the user gives no kv_cache_memory.
CPU_FREE_MEMORY_FRACTION = 0.2
CPU_DEFAULT_CAP = 4 << 30
GPU_FREE_MEMORY_FRACTION = 0.8


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def default_kv_cache_memory(device: torch.device, wanted: int) -> int:
    """A share of free memory, but never more than the configured sequences could ever use."""
    free = available_memory(device)
    if device.type == "cuda":
        budget = int(free * GPU_FREE_MEMORY_FRACTION)
    else:
        budget = min(int(free * CPU_FREE_MEMORY_FRACTION), CPU_DEFAULT_CAP)
    return min(budget, wanted)
