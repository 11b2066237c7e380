"""The CUDA backend: attention and the KV write in Triton (kernels/triton/paged_attention.py).

Every sequence of a step, decodes, verifications and prefill chunks alike, is computed straight from
the block tables by one kernel launch per layer; int8 / fp8 caches are read in place. The metadata
of a step is four device tensors (block tables, query offsets, context lengths, cache slots). For
CUDA graphs, a decode-only step's metadata can instead be written into persistent buffers padded to
a batch-size bucket (`CudaMetadataBuilder.allocate_graph_buffers`, `prepare(batch, pad_to=...)`).
The layers' elementwise ops are still the portable ones. LoRA adapters run on the Triton shrink and
expand (kernels/triton/lora_buffers.py).

The backend runs on a CUDA device. With TRITON_INTERPRET=1 it may also be built on the CPU, where
the kernels run in Triton's interpreter: that exists for the tests, and is far too slow for anything else.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from tachyllm.backends.base import AttentionMetadata, Backend, LayerKV, MetadataBuilder
from tachyllm.backends.cpu_backend import kernel_caches
from tachyllm.backends.registry import register_backend
from tachyllm.kernels.triton import interpreting
from tachyllm.step import StepBatch


@dataclass(kw_only=True, eq=False)
class CudaMetadata(AttentionMetadata):
    block_tables: torch.Tensor  # int32 [seqs, max blocks]
    query_start: torch.Tensor  # int32 [seqs + 1]: sequence s has the batch rows query_start[s] .. [s + 1] - 1
    seq_lens: torch.Tensor  # int32 [seqs]: each sequence's context length after this step's tokens


@dataclass(eq=False)
class GraphBuffers:
    """Persistent step inputs for CUDA graphs, allocated once: a captured graph reads these addresses.

    The per-token and per-sequence tensors are views of one device byte buffer, mirrored by one host
    buffer (pinned on a GPU) of the same layout, which ends with the step's block tables packed to
    their used width: a padded step is written into the host buffer and goes up in one asynchronous
    copy of its used prefix, and the packed tables are spread into `block_tables` on the device."""

    queries_per_seq: int  # batch rows per sequence in a padded step (1, or 1 + drafts for verification)
    input_ids: torch.Tensor  # int64 [max_num_seqs * queries_per_seq]
    positions: torch.Tensor  # int64 [max_num_seqs * queries_per_seq]
    slot_mapping: torch.Tensor  # int64 [max_num_seqs * queries_per_seq]
    query_start: torch.Tensor  # int32 [max_num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [max_num_seqs]
    packed_tables: torch.Tensor  # int32 [max_num_seqs * max_blocks]: a step's tables, [pad_to, width] row-major
    block_tables: torch.Tensor  # int32 [max_num_seqs, max_blocks], a tensor of its own
    device_bytes: torch.Tensor  # uint8: the tensors above, all but block_tables, are views of it
    host_bytes: torch.Tensor  # uint8, the same layout on the host
    host: dict[str, np.ndarray]  # numpy views of host_bytes, by field name
    packed_offset: int  # byte offset of packed_tables in both buffers
    uploaded: torch.cuda.Event | None = None  # the last upload's end: the host buffer is free again after it


# The uploaded fields in layout order, with dtypes; the packed tables last, so that a step copies a prefix.
_UPLOADED = (("input_ids", torch.long), ("positions", torch.long), ("slot_mapping", torch.long),
             ("query_start", torch.int32), ("seq_lens", torch.int32), ("packed_tables", torch.int32))  # fmt: skip


class CudaMetadataBuilder(MetadataBuilder):
    def __init__(self, backend: Backend, kv_caches: list[LayerKV], block_size: int):
        super().__init__(backend, kv_caches, block_size)
        self.graph_buffers: GraphBuffers | None = None

    def allocate_graph_buffers(self, max_num_seqs: int, max_blocks: int, queries_per_seq: int = 1) -> GraphBuffers:
        """Allocates the persistent buffers that `prepare(batch, pad_to=...)` writes into: room for
        `max_num_seqs` sequences of up to `queries_per_seq` tokens and `max_blocks` KV blocks each."""
        if min(max_num_seqs, max_blocks, queries_per_seq) < 1:
            raise ValueError(f"graph buffers need positive sizes, got {max_num_seqs}, {max_blocks}, {queries_per_seq}")
        tokens = max_num_seqs * queries_per_seq
        sizes = {"input_ids": tokens, "positions": tokens, "slot_mapping": tokens, "query_start": max_num_seqs + 1,
                 "seq_lens": max_num_seqs, "packed_tables": max_num_seqs * max_blocks}  # fmt: skip
        offsets, size = {}, 0
        for name, dtype in _UPLOADED:
            offsets[name] = size
            size += -(-sizes[name] * dtype.itemsize // 64) * 64  # 64-byte aligned regions
        device_bytes = torch.zeros(size, dtype=torch.uint8, device=self.device)
        host_bytes = torch.zeros(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

        def carve(buffer: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
            return buffer[offsets[name] : offsets[name] + sizes[name] * dtype.itemsize].view(dtype)

        views = {name: carve(device_bytes, name, dtype) for name, dtype in _UPLOADED}
        host = {name: carve(host_bytes, name, dtype).numpy() for name, dtype in _UPLOADED}
        views["slot_mapping"].fill_(-1)
        host["slot_mapping"].fill(-1)
        self.graph_buffers = GraphBuffers(
            queries_per_seq,
            **views,
            block_tables=torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=self.device),
            device_bytes=device_bytes,
            host_bytes=host_bytes,
            host=host,
            packed_offset=offsets["packed_tables"],
            uploaded=torch.cuda.Event() if self.device.type == "cuda" else None,
        )
        return self.graph_buffers

    def prepare(self, batch: StepBatch, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor, CudaMetadata]:
        """(input ids, positions, metadata) of the step, as fresh device tensors.

        With `pad_to` (for CUDA graphs; `allocate_graph_buffers` first): the batch must be decode-only
        (each sequence one token, plus at most queries_per_seq - 1 drafts) with at most `pad_to`
        sequences, pad_to <= max_num_seqs. Everything is copied into the persistent buffers, and the
        tensors returned are their leading views, the same addresses at every step of this `pad_to`:
        pad_to * queries_per_seq token rows (padding rows: input id 0, position 0, cache slot -1, so
        nothing is written) and pad_to sequences (padding sequences have no queries and a context of
        0, so they read nothing), with block tables of the buffers' full width. Rows of the output
        past the batch's real tokens are garbage, to be ignored."""
        if pad_to is not None:
            return self._prepare_padded(batch, pad_to)
        ids, positions, slots, query_start, seq_lens, tables = self._host_inputs(batch)
        width = max(len(t) for t in tables)
        device = self.device
        meta = CudaMetadata(
            backend=self.backend,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        )
        if batch.seqs[0].window_block_table is not None:
            window_tables = [s.window_block_table or [] for s in batch.seqs]  # all have one when the first has
            meta.sliding = CudaMetadata(
                backend=self.backend,
                slot_mapping=self.slot_mapping(batch, window_tables),
                block_tables=torch.tensor(
                    [t + [0] * (width - len(t)) for t in window_tables], dtype=torch.int32, device=device
                ),
                query_start=meta.query_start,
                seq_lens=meta.seq_lens,
            )
        return (
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            meta,
        )

    def _prepare_padded(self, batch: StepBatch, pad_to: int) -> tuple[torch.Tensor, torch.Tensor, CudaMetadata]:
        buf = self.graph_buffers
        if buf is None:
            raise RuntimeError("prepare(pad_to=...) needs allocate_graph_buffers() first")
        max_seqs, max_blocks = buf.block_tables.shape
        if not len(batch.seqs) <= pad_to <= max_seqs:
            raise ValueError(f"cannot pad {len(batch.seqs)} sequences to {pad_to} (buffers for {max_seqs})")
        if batch.seqs[0].window_block_table is not None:
            raise ValueError("a padded step has no sliding-window pool's buffers (the engine captures no graphs then)")
        if any(not s.is_decode or len(s.token_ids) > buf.queries_per_seq for s in batch.seqs):
            raise ValueError(f"a padded step is decode-only, at most {buf.queries_per_seq} tokens per sequence")
        ids, positions, slots, query_start, seq_lens, tables = self._host_inputs(batch)
        width = max(len(t) for t in tables)
        if width > max_blocks:
            raise ValueError(f"a block table of {width} blocks does not fit the graph buffers' {max_blocks}")
        tokens, real, seqs = pad_to * buf.queries_per_seq, len(ids), len(batch.seqs)
        if buf.uploaded is not None:  # the last upload has read the host buffer (long since, normally)
            buf.uploaded.synchronize()
        h = buf.host
        h["input_ids"][:real], h["input_ids"][real:tokens] = ids, 0
        h["positions"][:real], h["positions"][real:tokens] = positions, 0
        h["slot_mapping"][:real], h["slot_mapping"][real:tokens] = slots, -1  # padding rows write nothing
        h["query_start"][: seqs + 1], h["query_start"][seqs + 1 : pad_to + 1] = query_start, real
        h["seq_lens"][:seqs], h["seq_lens"][seqs:pad_to] = seq_lens, 0  # padding sequences read nothing
        # The tables packed to their used width: columns past a sequence's context are never read.
        packed = h["packed_tables"][: pad_to * width].reshape(pad_to, width)
        for row, table in zip(packed, tables):
            row[: len(table)], row[len(table) :] = table, 0
        packed[seqs:] = 0
        end = buf.packed_offset + pad_to * width * 4
        buf.device_bytes[:end].copy_(buf.host_bytes[:end], non_blocking=True)
        buf.block_tables[:pad_to, :width].copy_(buf.packed_tables[: pad_to * width].view(pad_to, width))
        if buf.uploaded is not None:
            buf.uploaded.record(torch.cuda.current_stream(self.device))  # the stream the upload ran on
        meta = CudaMetadata(
            backend=self.backend,
            slot_mapping=buf.slot_mapping[:tokens],
            block_tables=buf.block_tables[:pad_to],
            query_start=buf.query_start[: pad_to + 1],
            seq_lens=buf.seq_lens[:pad_to],
        )
        return buf.input_ids[:tokens], buf.positions[:tokens], meta

    def _host_inputs(
        self, batch: StepBatch
    ) -> tuple[list[int], list[int], list[int], list[int], list[int], list[list[int]]]:
        """Input ids, positions and cache slots per token; query offsets, context lengths and block
        tables per sequence; as Python lists."""
        ids, positions, slots = self.token_lists(batch)
        query_start, seq_lens = [0], []
        for s in batch.seqs:
            query_start.append(query_start[-1] + len(s.token_ids))
            seq_lens.append(s.start + len(s.token_ids))
        return ids, positions, slots, query_start, seq_lens, [s.block_table for s in batch.seqs]


@register_backend
class CudaBackend(Backend):
    name = "cuda"
    description = "Triton paged attention, fused ops and quantized GEMMs on the GPU; CUDA graphs for decodes"
    graph_capturable = True  # the builder's prepare(batch, pad_to) fills persistent buffers

    def __init__(self, device: torch.device):
        super().__init__(device)
        # These import triton: only once the backend is chosen.
        from tachyllm.backends.triton_ops import TritonOps
        from tachyllm.kernels.triton import lora_buffers, paged_attention, quant_matmul

        self.ops = TritonOps()
        self._quant_matmul = quant_matmul
        self._lora = lora_buffers
        self._write_kv = paged_attention.write_kv
        self._paged_attention = paged_attention.paged_attention

    def quantized_matmul_kernels(self) -> ModuleType:
        return self._quant_matmul

    def lora_kernels(self) -> ModuleType:
        return self._lora

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "needs a CUDA device (and triton), and triton is not installed"
        if device.type == "cuda" or (device.type == "cpu" and interpreting()):
            return None  # the CPU: Triton's interpreter, for the tests
        return f"needs a CUDA device (and triton), and the device is {device}"

    def metadata_builder(self, kv_caches: list[LayerKV], block_size: int) -> CudaMetadataBuilder:
        return CudaMetadataBuilder(self, kv_caches, block_size)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKV,
        meta: CudaMetadata,  # type: ignore[override]  # a backend gets the metadata its own builder made
        scale: float,
        layer: int,
        window: int | None = None,
    ) -> torch.Tensor:
        (kc, ks), (vc, vs) = kernel_caches(*kv_cache)
        self._write_kv(k, v, kc, vc, meta.slot_mapping, ks, vs)
        return self._paged_attention(
            q, kc, vc, meta.block_tables, meta.query_start, meta.seq_lens, scale, window=window, k_scale=ks, v_scale=vs
        )
