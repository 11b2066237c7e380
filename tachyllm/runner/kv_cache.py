"""Sizing the paged KV cache: bytes per block and the default memory budget. The backend
allocates it (Backend.allocate_kv_cache)."""

from __future__ import annotations

import logging

import torch

from tachyllm.config import ModelConfig
from tachyllm.errors import ConfigError

logger = logging.getLogger("tachyllm")

# Default share of free memory for the cache when the user gives no kv_cache_memory.
CPU_FREE_MEMORY_FRACTION = 0.2
CPU_DEFAULT_CAP = 4 << 30
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU's whole memory


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


def default_kv_cache_memory(
    device: torch.device, wanted: int, gpu_memory_utilization: float | None = None, reserved: int = 0
) -> int:
    """Never more than the configured sequences could ever use. On a GPU, vLLM's rule: the engine may
    hold `gpu_memory_utilization` of the device's whole memory, and the KV cache gets what the memory
    in use now (the weights just loaded, other processes) and `reserved` (CUDA graphs, captured after
    the cache exists) leave of it; activations are not profiled, so keep some headroom. On the CPU, a
    share of free memory."""
    if device.type != "cuda":
        if gpu_memory_utilization is not None:
            logger.info("--gpu-memory-utilization applies to a CUDA device: ignored on the CPU (see --kv-cache-memory)")
        return min(min(int(available_memory(device) * CPU_FREE_MEMORY_FRACTION), CPU_DEFAULT_CAP), wanted)
    utilization = GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free) - reserved
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization {utilization:g} leaves no room for the KV cache: {(total - free) / 2**30:.1f} GiB "
            f"of the device's {total / 2**30:.1f} GiB are in use (weights, other processes) and CUDA graphs need "
            f"{reserved / 2**30:.1f} GiB; raise it"
        )
    return min(budget, wanted)
