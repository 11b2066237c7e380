"""The adapters an engine keeps loaded: each in a slot of the model's wrapped linears (layers.py), up to
max_cpu_loras of them, the least recently used one not in use by a request evicted for a new one."""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from types import ModuleType

import torch

from tachyllm import huge_pages
from tachyllm.errors import AdapterError
from tachyllm.lora.adapter_files import load_adapter
from tachyllm.lora.layers import StepSegments, attach_lora
from tachyllm.lora.peft import LoRAAdapter, projection_shapes
from tachyllm.lora.request import LoRARequest
from tachyllm.model_config import ModelConfig
from tachyllm.models.llama import LlamaForCausalLM

logger = logging.getLogger("tachyllm")
# One projection of each linear of a fused decoder layer, in the order its set_lora takes them.
FUSED_ORDER = ("q_proj", "o_proj", "gate_proj", "down_proj")

# Upper bounds (seconds) of the adapter load-time histogram: from a small adapter read from the page
# cache to a large one read from a slow disk.
LOAD_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class LoadTimes:
    """The adapters' load times (reading and checking the files, installing the weights) as a histogram:
    loads per bucket of LOAD_TIME_BUCKETS (the last one: above them all), and their total."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_TIME_BUCKETS) + 1))
    total_seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(LOAD_TIME_BUCKETS, seconds)] += 1
        self.total_seconds += seconds


@dataclass
class LoadedAdapter:
    request: LoRARequest
    adapter: LoRAAdapter
    slot: int  # 1 .. max_cpu_loras; 0 is the base model


class LoRAManager:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelConfig,
        device: torch.device,
        max_lora_rank: int,
        max_cpu_loras: int,
        kernels: ModuleType | None = None,
        dtype: torch.dtype = torch.float32,
        max_tokens: int = 0,
        lora_dtype: str = "auto",
    ):
        """`kernels`: the backend's LoRA segment kernels (Backend.lora_kernels; None: PyTorch matmuls).
        The model's fused decoder layers run the adapters through them; without them, or where a fused
        layer cannot take adapters, the layer runs as modules. `dtype`: the model's activations;
        `lora_dtype`: how the adapters' weights are stored (StepSegments.weight_dtype_for).
        `max_tokens`: the most rows a step has, which kernels of fixed-size buffers are built for."""
        self.model_config = cfg
        self.max_lora_rank = max_lora_rank
        self.capacity = max_cpu_loras
        self.segments = StepSegments(device, kernels, dtype, max_tokens, max_lora_rank, max_cpu_loras, lora_dtype)
        self.layers = attach_lora(model, projection_shapes(cfg), self.segments)
        for layer, wrappers in zip(model.layers, self.layers):
            fused = getattr(layer, "fused", None)  # the backend's fused form of the layer (models/llama.py)
            if fused is None:
                continue
            set_lora = getattr(fused, "set_lora", None)
            if self.segments.native is None or set_lora is None:
                setattr(layer, "fused", None)  # it would bypass the wrapped linears
                continue
            set_lora(self.segments.native, *(wrappers[p].native for p in FUSED_ORDER))
        # By the whole LoRARequest (name, id, path): a request that differs in any of them is another
        # adapter, read anew (the server gives an adapter loaded again over HTTP a new id). Least
        # recently used first.
        self.loaded: OrderedDict[LoRARequest, LoadedAdapter] = OrderedDict()
        # Adapters read by prepare() on another thread, waiting for their first request's acquire();
        # guarded by _lock (the only state shared with other threads), oldest first.
        self._prepared: OrderedDict[LoRARequest, tuple[LoRAAdapter, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.load_times = LoadTimes()
        self.requests_by_name: dict[str, int] = {}  # requests admitted per adapter name

    def prepare(self, request: LoRARequest) -> None:
        """Reads and checks `request`'s adapter files (raising AdapterError), so that its acquire()
        installs it without reading them: any thread, the engine's keeps stepping meanwhile. Reading
        a file is what takes time; installing it into the wrapped linears is a copy per projection."""
        if not isinstance(request, LoRARequest):
            raise AdapterError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            if request in self._prepared or request in self.loaded:  # a dict lookup: safe beside the engine
                return
        t0 = time.perf_counter()
        adapter = load_adapter(request.lora_path, self.model_config, self.max_lora_rank)
        with self._lock:
            self._prepared[request] = (adapter, time.perf_counter() - t0)
            while len(self._prepared) > self.capacity:  # prepared for requests that never came
                self._prepared.popitem(last=False)

    def acquire(self, request: LoRARequest, in_use: set[int]) -> LoadedAdapter:
        """The loaded adapter of `request`, loading it first if need be (evicting the least recently
        used adapter whose slot is not in `in_use`)."""
        if not isinstance(request, LoRARequest):
            raise AdapterError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        loaded = self.loaded.get(request)
        if loaded is not None:
            self.loaded.move_to_end(request)
            return loaded
        t0 = time.perf_counter()
        with self._lock:
            prepared = self._prepared.pop(request, None)
        if prepared is None:  # not prepared (the offline engine): read here, on the engine's thread
            adapter, read_s = load_adapter(request.lora_path, self.model_config, self.max_lora_rank), 0.0
        else:
            adapter, read_s = prepared
        slot = self._free_slot(in_use)
        self._install(slot, adapter)
        loaded = self.loaded[request] = LoadedAdapter(request, adapter, slot)
        load_s = read_s + time.perf_counter() - t0
        self.load_times.add(load_s)
        logger.info(
            "LoRA adapter %r loaded in %.3f s (%s): rank %d, scale %g, %d projections, slot %d",
            request.lora_name, load_s, "read beforehand" if prepared else "read on the engine thread",
            adapter.rank, adapter.scale, len(adapter.weights), slot,
        )  # fmt: skip
        return loaded

    def _free_slot(self, in_use: set[int]) -> int:
        """A slot for one more adapter: while the cache is full, the least recently used adapters that no
        request uses are evicted. When every one is in use the cache grows past max_cpu_loras rather than
        refuse the request (vLLM would keep it waiting); it shrinks back at later loads."""
        for request, loaded in list(self.loaded.items()):  # least recently used first
            if len(self.loaded) < self.capacity:
                break
            if loaded.slot not in in_use:
                self._evict(request)
        if len(self.loaded) >= self.capacity:
            logger.info(
                "all %d loaded LoRA adapters are in use: one more is kept loaded (max_cpu_loras=%d) until "
                "requests finish", len(self.loaded), self.capacity,
            )  # fmt: skip
        taken = {a.slot for a in self.loaded.values()}
        return next(slot for slot in itertools.count(1) if slot not in taken)

    def _evict(self, request: LoRARequest) -> None:
        loaded = self.loaded.pop(request)
        for wrappers in self.layers:
            for wrapper in set(wrappers.values()):
                wrapper.clear_adapter(loaded.slot)
        logger.info("LoRA adapter %r evicted from slot %d", request.lora_name, loaded.slot)

    def _install(self, slot: int, adapter: LoRAAdapter) -> None:
        tensors: list[torch.Tensor] = []
        for index, wrappers in enumerate(self.layers):
            for wrapper in set(wrappers.values()):
                pieces = {p: adapter.weights[(index, p)] for p in wrapper.projections if (index, p) in adapter.weights}
                wrapper.set_adapter(slot, pieces, adapter.scale)
                tensors += wrapper.slot_tensors(slot)
        if self.segments.device.type == "cpu":
            # On huge pages, as the base weights are: a decode step reads every wrapped linear's share
            # of the adapter from memory, and on 4 KiB pages that cost a quantized model's step several
            # times what the bytes take (docs/design_measurements.md#lora-adapters-over-quantized-weights).
            huge_pages.move_tensors(tensors, f"LoRA adapter in slot {slot}")
