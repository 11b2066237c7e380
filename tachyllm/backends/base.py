"""What an execution backend is: the one place that knows which kernels run a step.

A backend is chosen once, at engine start (backends/registry.py), and handed to everything that
used to ask "are the C++ kernels here?" at call time:

- the model is built with the backend's elementwise ops (`ops`: RMSNorm, residual add + norm,
  rotary, SiLU-and-multiply), its quantized linears with its block kernels, and may have its
  decoder layers replaced by the backend's fused ones (`fused_decoder_layer`);
- the engine allocates the KV cache through it (`allocate_kv_cache`: its layout, fp8/int8 storage
  with calibrated scales included);
- each model runner gets a `MetadataBuilder` from it (`metadata_builder`), which turns a StepBatch
  into the model's inputs and this backend's AttentionMetadata; per-sequence state it keeps between
  steps is its own;
- the model's attention layers call `attention` of the backend that built the step's metadata
  (with a sliding window for the layers that have one).

A new backend is one module: subclass Backend (and MetadataBuilder / AttentionMetadata), decorate
it with `@register_backend`, and import it in tachyllm/backends/__init__.py.
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from tachyllm.kernels.kv_quant import QuantizedKV

if TYPE_CHECKING:
    from tachyllm.model_config import ModelConfig
    from tachyllm.step import StepBatch

# One layer's (K, V) cache: [blocks, block_size, kv_heads, head_dim] in the model dtype, or quantized storage.
LayerKV = tuple[torch.Tensor | QuantizedKV, torch.Tensor | QuantizedKV]
# Per-(layer) (K scale, V scale) of a quantized cache, [kv_heads, 1] fp32 each (quantization/kv_calibration.py).
KVScales = list[tuple[torch.Tensor, torch.Tensor]]
# A decoder layer as one call: (x, residual, positions, kv_cache, meta) -> (x, residual).
FusedLayer = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(kw_only=True, eq=False)
class AttentionMetadata:
    """One step's attention inputs, as a backend's MetadataBuilder made them."""

    backend: Backend  # whose `attention` reads this metadata
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot where each token's K/V is written
    # Whether the backend's fused decoder layers (where it built them) run this step.
    fused_layers: bool = False
    # The sliding-window layers' metadata (their slots and block tables), where they have a KV pool of
    # their own (ScheduledSeq.window_block_table); None: they read this one.
    sliding: AttentionMetadata | None = None


@dataclass(kw_only=True, eq=False)
class EncoderMetadata(AttentionMetadata):
    """An encoder step's attention inputs (MetadataBuilder.prepare_encoder): the step's inputs packed one
    after another, each attending to itself only, bidirectionally; nothing is written to a KV cache. The
    step's rows are its inputs', then padding up to a multiple of ENCODER_STEP_ROW_MULTIPLE. A backend
    with a packed encoder kernel subclasses it (Backend.encoder_metadata)."""

    seq_lens: list[int]  # tokens of each input, in row order


@dataclass(kw_only=True, eq=False)
class PaddedEncoderMetadata(EncoderMetadata):
    """The portable encoder attention's layout: inputs padded to a multiple of ENCODER_PAD_MULTIPLE tokens,
    one SDPA call per padded length. `padded_rows` gathers the step's rows into that layout (padding
    repeats an input's last row, masked out as a key), `buckets` are its (padded length, inputs) in order
    with each one's key mask [inputs, 1, 1, length], and `unpadded_rows` picks every row of the step back
    out, in row order."""

    padded_rows: torch.Tensor
    buckets: list[tuple[int, int, torch.Tensor]]
    unpadded_rows: torch.Tensor


# An encoder input's attention is padded to a multiple of this many tokens, a length that depends on the
# input alone (so its result does not depend on the step's other inputs): one attention call per 16
# lengths instead of one per length (docs/design_measurements.md#encoder-attention).
ENCODER_PAD_MULTIPLE = 16
# An encoder step's rows are padded to a multiple of this many (rows that belong to no input, dropped
# before pooling), so its linears and GELU see one of few row counts: oneDNN builds a kernel for each
# new row count it meets, ~3 ms on a MiniLM-sized step, which would otherwise fall on the first request
# of each input length. 8 rather than 16: a lone short input computes 3.5 padding rows on average, not
# 7.5, for a quarter of a second more at start (docs/design_measurements.md#served-embedding-latency).
ENCODER_STEP_ROW_MULTIPLE = 8


class LayerOps:
    """The elementwise ops of the model layers, in portable PyTorch. A backend with kernels for
    them subclasses this; the layers call whichever object they were built with."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [tokens, heads, head_dim] and k in the half-split (NeoX / HF) layout."""
        cos = cos[positions].unsqueeze(1)  # [tokens, 1, head_dim / 2]
        sin = sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU (tanh approximation) of the gate times up: Gemma's MLP."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


PORTABLE_OPS = LayerOps()


class MetadataBuilder(ABC):
    """Belongs to one model runner (one KV cache): prepares each of its steps.

    A graph_capturable backend's builder takes `prepare(batch, pad_to=n)`: it pads a decode-only step
    to n sequences (the padding rows' outputs are dropped); see Backend.graph_capturable."""

    def __init__(self, backend: Backend, kv_caches: list[LayerKV], block_size: int):
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = backend.device

    @abstractmethod
    def prepare(
        self, batch: StepBatch, pad_to: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, metadata) of the step; reads only the batch."""

    def allocate_graph_buffers(self, max_num_seqs: int, max_blocks: int, queries_per_seq: int = 1) -> object:
        """The persistent buffers `prepare(batch, pad_to=...)` writes a decode-only step into, for
        CUDA graphs: up to `max_num_seqs` sequences of `queries_per_seq` tokens and `max_blocks` KV
        blocks each. Builders of backends that are not graph_capturable keep none."""
        return None

    def token_inputs(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids, positions and cache slots (full-attention tables) of every token of the batch, in row order."""
        input_ids, positions, slot_mapping = self.token_lists(batch)
        device = self.device
        return (
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(slot_mapping, dtype=torch.long, device=device),
        )

    def token_lists(self, batch: StepBatch) -> tuple[list[int], list[int], list[int]]:
        """token_inputs as Python lists."""
        input_ids: list[int] = []
        positions: list[int] = []
        for s in batch.seqs:
            input_ids += s.token_ids
            positions += range(s.start, s.start + len(s.token_ids))
        return input_ids, positions, self.slot_list(batch, [s.block_table for s in batch.seqs])

    def slot_mapping(self, batch: StepBatch, tables: list[list[int]]) -> torch.Tensor:
        """The flat cache slot of every token of the batch, in row order, by one block table per sequence
        (the full-attention or the sliding-window layers' pool)."""
        return torch.tensor(self.slot_list(batch, tables), dtype=torch.long, device=self.device)

    def slot_list(self, batch: StepBatch, tables: list[list[int]]) -> list[int]:
        """slot_mapping as a Python list."""
        bs = self.block_size
        slots: list[int] = []
        for s, table in zip(batch.seqs, tables):
            slots += [table[p // bs] * bs + p % bs for p in range(s.start, s.start + len(s.token_ids))]
        return slots


class Backend(ABC):
    name: ClassVar[str]  # as EngineConfig.backend names it
    description: ClassVar[str]  # for the start-up log
    # Its builders' `prepare(batch, pad_to=n)` write a decode-only step's inputs and metadata into the
    # same memory every time, in shapes that depend only on n and the queries per sequence, and its
    # kernels launch without host syncs: a CUDA graph captured over them replays any step of that
    # shape (runner/cuda_graphs.py).
    graph_capturable: ClassVar[bool] = False

    def __init__(self, device: torch.device):
        self.device = device
        self.ops: LayerOps = PORTABLE_OPS

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device` here, or None when it can."""
        return None

    # -- building the model ------------------------------------------------------------------
    def block_kernels(self) -> ModuleType | None:
        """Kernels for GGUF-style 32-weight blocks (int4 Q4_1, Q8_0) that quantized linears pack
        their weights for, or None (they use aten's int4 layout, or dequantize)."""
        return None

    def bf16_linear_kernels(self) -> ModuleType | None:
        """A bf16 matrix-vector kernel that plain linears run for few-token inputs, or None."""
        return None

    def quantized_matmul_kernels(self) -> ModuleType | None:
        """Kernels that int4 (every source: RTN, AWQ, GPTQ, GGUF Q4_0 / Q4_1) and int8 weight-only
        linears run on with the weights packed, dequantizing inside the matmul, or None. The module
        provides pack_int4 / int4_matmul and pack_int8 / int8_matmul as kernels/triton/quant_matmul.py
        does."""
        return None

    def lora_kernels(self) -> ModuleType | None:
        """Kernels for LoRA adapters, with LoRAStep and LoRASlots as kernels/csrc/lora.h declares them
        (the step's rows grouped by adapter; one wrapped linear's adapters by slot), which the wrapped
        linears (tachyllm/lora/layers.py) call and the backend's fused decoder layers, if it has any,
        take through `set_lora`; a module with `FIXED_SIZE` builds them with sizes, for buffers of fixed
        size (kernels/triton/lora_buffers.py). Or None: the wrapped linears use PyTorch matmuls and the
        fused layers are off with adapters."""
        return None

    def fused_decoder_layer(self, layer, rotary) -> FusedLayer | None:
        """The decoder layer as one call, or None where this backend has no fused form for it."""
        return None

    # -- the KV cache ------------------------------------------------------------------------
    def allocate_kv_cache(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        scales: KVScales | None = None,
        window_blocks: int = 0,
    ) -> list[LayerKV]:
        """Per layer (K, V) caches [blocks, block_size, kv_heads, head_dim] carved out of one
        allocation; with `window_blocks`, the sliding-window layers (cfg.sliding_layers) get a pool
        of that many blocks of their own, the other layers num_blocks. With `scales`, `dtype` is a
        quantized storage type and each is a QuantizedKV."""
        sliding = [i for i in range(cfg.num_layers) if window_blocks and i in cfg.sliding_layers]
        full = [i for i in range(cfg.num_layers) if i not in sliding]
        by_layer: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * cfg.num_layers
        for layers, blocks in ((full, num_blocks), (sliding, window_blocks)):
            if layers:
                storage = self._zeroed((len(layers), 2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim), dtype)
                for j, layer in enumerate(layers):
                    by_layer[layer] = (storage[j, 0], storage[j, 1])
        caches = [kv for kv in by_layer if kv is not None]
        assert len(caches) == cfg.num_layers, "every layer is a full-attention or a sliding one"
        if scales is None:
            return list[LayerKV](caches)
        flat = (-1, cfg.num_kv_heads, cfg.head_dim)
        return [
            (
                QuantizedKV(k.view(flat), ks.to(self.device), block_size),
                QuantizedKV(v.view(flat), vs.to(self.device), block_size),
            )
            for (k, v), (ks, vs) in zip(caches, scales)
        ]

    def _zeroed(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Zero-filled: attention reads padding slots (masked out) and 0 * garbage could be NaN.
        if self.device.type == "cpu":
            # A fresh anonymous mapping: the OS hands out zero pages on first touch, so a multi-GiB
            # cache costs nothing until it is used (torch.zeros writes every byte). Not numpy's
            # zeros (calloc), which asks for transparent huge pages on large arrays: on this VM first
            # writes to that memory cost several times more (measurements:
            # docs/design_measurements.md#kv-cache-allocation).
            raw = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    # -- running steps -----------------------------------------------------------------------
    @abstractmethod
    def metadata_builder(self, kv_caches: list[LayerKV], block_size: int) -> MetadataBuilder:
        """A builder for the steps of one model runner over these caches."""

    @abstractmethod
    def attention(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
        scale: float,
        layer: int,
        window: int | None = None,
    ) -> torch.Tensor:
        """Writes this step's K/V into the layer's cache and returns attention over each
        sequence's context, [tokens, heads, head_dim]. With a `window`, a query sees only the
        `window` positions up to its own, and cache blocks wholly before every query's window of
        the step are not read."""

    def prepare_encoder(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EncoderMetadata]:
        """(input ids, positions, token type ids, metadata) of an encoder step: every sequence is a whole
        input, computed from its first token (ScheduledSeq.pooling carries its token types); rows after
        the inputs' pad the step to a multiple of ENCODER_STEP_ROW_MULTIPLE."""
        input_ids: list[int] = []
        positions: list[int] = []
        token_types: list[int] = []
        seq_lens: list[int] = []
        for s in batch.seqs:
            n = len(s.token_ids)
            assert s.start == 0 and s.completes, "an encoder computes each input whole, in one step"
            input_ids += s.token_ids
            positions += range(n)
            types = s.pooling.token_type_ids if s.pooling is not None else None
            token_types += types if types is not None else [0] * n
            seq_lens.append(n)
        # The step's padding rows after the last input: token 0 at position 0, their outputs unread.
        step_padding = -len(input_ids) % ENCODER_STEP_ROW_MULTIPLE
        input_ids += [0] * step_padding
        positions += [0] * step_padding
        token_types += [0] * step_padding
        device = self.device
        return (
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(token_types, dtype=torch.long, device=device),
            self.encoder_metadata(seq_lens, len(input_ids)),
        )

    def encoder_metadata(self, seq_lens: list[int], rows: int) -> EncoderMetadata:
        """The attention metadata of an encoder step of these inputs (in row order) and `rows` rows in all
        (the inputs', then the step's padding): the portable attention's padded layout."""
        padded_rows: list[int] = []
        # The step's padding rows take attention row 0's output: any row will do, nothing reads them.
        unpadded_rows = [0] * rows
        by_padded_length: dict[int, list[tuple[int, int]]] = {}  # padded length -> (first row, length)
        first = 0
        for n in seq_lens:
            padded = -(-n // ENCODER_PAD_MULTIPLE) * ENCODER_PAD_MULTIPLE
            by_padded_length.setdefault(padded, []).append((first, n))
            first += n
        buckets = []
        for padded, inputs in sorted(by_padded_length.items()):
            for first, n in inputs:
                for i in range(n):
                    unpadded_rows[first + i] = len(padded_rows) + i
                padded_rows += range(first, first + n)
                padded_rows += [first + n - 1] * (padded - n)
            lengths = torch.tensor([n for _, n in inputs])
            mask = (torch.arange(padded) < lengths.unsqueeze(1)).view(len(inputs), 1, 1, padded)
            buckets.append((padded, len(inputs), mask.to(self.device)))
        device = self.device
        return PaddedEncoderMetadata(
            backend=self,
            slot_mapping=torch.empty(0, dtype=torch.long, device=device),
            seq_lens=seq_lens,
            padded_rows=torch.tensor(padded_rows, dtype=torch.long, device=device),
            buckets=buckets,
            unpadded_rows=torch.tensor(unpadded_rows, dtype=torch.long, device=device),
        )

    def encoder_attention(
        self,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, heads, head_dim]
        v: torch.Tensor,
        meta: EncoderMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Bidirectional attention of each packed input over itself (no mask within it, no KV cache),
        [tokens, heads, head_dim]. Portable form: the inputs padded to one length attend together in one
        SDPA call over [inputs, heads, length, head_dim], their padding masked out as keys, so none sees
        another; an input's padded length is its own, so its result does not depend on the others."""
        assert isinstance(meta, PaddedEncoderMetadata), "the metadata of this backend's encoder_metadata"
        heads, head_dim = q.shape[1], q.shape[2]
        qp, kp, vp = (t.index_select(0, meta.padded_rows) for t in (q, k, v))
        outputs = []
        row = 0
        for length, count, mask in meta.buckets:
            end = row + count * length
            qb, kb, vb = (t[row:end].view(count, length, heads, head_dim).transpose(1, 2) for t in (qp, kp, vp))
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
            outputs.append(o.transpose(1, 2).reshape(-1, heads, head_dim))
            row = end
        return torch.cat(outputs).index_select(0, meta.unpadded_rows)
