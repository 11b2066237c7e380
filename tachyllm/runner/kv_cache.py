"""Sizing the paged KV cache: bytes per block, the pools (one, or a full-attention and a
sliding-window one) and the default memory budget. The backend allocates it (Backend.allocate_kv_cache)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tachyllm.errors import ConfigError
from tachyllm.model_config import ModelConfig

logger = logging.getLogger("tachyllm")

# Default share of free memory for the cache when the user gives no kv_cache_memory.
CPU_FREE_MEMORY_FRACTION = 0.2
CPU_DEFAULT_CAP = 4 << 30
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU's whole memory


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """One block of every layer (or of num_layers layers)."""
    layers = cfg.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVCacheLayout:
    """The blocks of the KV cache's pools. A model with sliding-window layers gives them a pool of their
    own (window_blocks, core/block_manager.py's NULL_BLOCK included) whose blocks the sequences release
    as they move past them; otherwise (window_blocks 0) every layer is in the one pool of num_blocks."""

    num_blocks: int
    block_bytes: int  # a block of num_blocks: every layer's, or the full-attention layers' only
    window_blocks: int = 0
    window_block_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes + self.window_blocks * self.window_block_bytes


def window_pool_blocks(
    cfg: ModelConfig, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """Blocks the sliding-window layers' own pool needs so that it never runs out before max_num_seqs
    sequences run (NULL_BLOCK included), or 0 where they keep the one pool: no sliding layers, no
    full-attention layer, or a window no sequence outgrows by a block. Between steps a sequence holds
    at most cdiv(window, block_size) + 1 window blocks; during a step one more, and the blocks of its
    new tokens, which are at most max_num_batched_tokens in all."""
    window = cfg.sliding_window
    if window is None:
        return 0
    if not cfg.sliding_layers or len(cfg.sliding_layers) == cfg.num_layers or max_model_len - window < block_size:
        return 0
    return 1 + max_num_seqs * (-(-window // block_size) + 2) + -(-max_num_batched_tokens // block_size)


def wanted_bytes(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> int:
    """What the configured sequences could ever use: max_num_seqs sequences of max_model_len tokens in
    the full-attention pool (every layer's without a window pool), and the window pool."""
    window_blocks = window_pool_blocks(cfg, block_size, max_num_seqs, max_num_batched_tokens, max_model_len)
    window_bytes = bytes_per_block(cfg, block_size, dtype, len(cfg.sliding_layers)) if window_blocks else 0
    full_bytes = bytes_per_block(cfg, block_size, dtype) - window_bytes
    return max_num_seqs * -(-max_model_len // block_size) * full_bytes + window_blocks * window_bytes


def kv_cache_layout(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    cache_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> KVCacheLayout:
    """The pools that fit cache_bytes. The window pool gets what window_pool_blocks asks, but no more
    blocks than one pool of every layer would have had (it holds a subset of what that one did); the
    full-attention layers' pool gets the rest, so it is never smaller than that one pool. A budget whose
    one pool could not even give the window pool what one sequence alone needs keeps the one pool."""
    one_pool = cache_bytes // bytes_per_block(cfg, block_size, dtype)
    window_blocks = window_pool_blocks(cfg, block_size, max_num_seqs, max_num_batched_tokens, max_model_len)
    if not window_blocks or one_pool < window_pool_blocks(cfg, block_size, 1, max_num_batched_tokens, max_model_len):
        return KVCacheLayout(one_pool, bytes_per_block(cfg, block_size, dtype))
    window_blocks = min(window_blocks, one_pool)
    window_bytes = bytes_per_block(cfg, block_size, dtype, len(cfg.sliding_layers))
    full_bytes = bytes_per_block(cfg, block_size, dtype, cfg.num_layers - len(cfg.sliding_layers))
    return KVCacheLayout(
        (cache_bytes - window_blocks * window_bytes) // full_bytes, full_bytes, window_blocks, window_bytes
    )


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
