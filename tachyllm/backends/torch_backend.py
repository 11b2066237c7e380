"""The portable backend: attention in plain PyTorch ops, on any device.

The batch is laid out decodes first, then prefill chunks. A decode is a sequence's last token,
possibly followed by draft tokens to verify (speculative decoding): a few queries at the end of
its context. Decodes are computed together as a grouped matmul + softmax over their gathered,
padded contexts, with their queries padded to the longest decode's; each prefill chunk is a
causal grouped matmul + softmax over query tiles. Both beat SDPA's CPU paths for these shapes
(SDPA with a mask and grouped KV heads was several times slower per layer for a chunk with cached
context; measurements: docs/design_measurements.md#attention-paths and docs/scheduler.md).
A sliding-window layer gathers and multiplies only the positions inside its queries' windows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tachyllm.backends.base import AttentionMetadata, Backend, LayerKV, MetadataBuilder
from tachyllm.backends.registry import register_backend
from tachyllm.kernels.kv_quant import QuantizedKV, kv_flat, kv_read, kv_write
from tachyllm.step import ScheduledSeq, StepBatch

# Queries per tile of a prefill chunk: bounds the fp32 score matrix to kv_heads x tile x group x context.
QUERY_TILE = 256
# Prompts at least this long keep a contiguous K/V copy while they are prefilled in chunks.
CHUNK_BUFFER_MIN_TOKENS = 256


@dataclass
class PrefillSpan:
    start: int  # token range [start, end) of this chunk in the flattened batch
    end: int
    # Flat cache slots of the whole context (cached tokens + this chunk), or None when the chunk
    # is the sequence's entire context so far and can attend to its own fresh K/V directly.
    context_slots: torch.Tensor | None
    num_cached: int  # tokens of context before this chunk (its first query's position)
    # A long prompt prefilled in chunks keeps a contiguous head-major copy of its K/V
    # ([layers, 2, kv_heads, capacity, head_dim]) that each chunk appends to, so a chunk does not
    # gather its whole context from the paged cache in every layer. `buffer_filled` tokens of it
    # are valid before this chunk (fewer than num_cached when it starts after a prefix-cache hit).
    buffer: torch.Tensor | None = None
    buffer_filled: int = 0


@dataclass(kw_only=True, eq=False)
class TorchMetadata(AttentionMetadata):
    num_decode_tokens: int = 0  # leading tokens of the batch that belong to decodes
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context] flat slots (padding slots are masked)
    # [num_decodes, 1, queries, 1, max_context]: 0 where query j of a decode may see a context slot, else -inf
    decode_bias: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_queries: int = 1  # queries per decode after padding
    # When decodes have different numbers of queries: the batch row of each padded query
    # ([num_decodes * decode_queries]), and the padded row of each real decode token.
    decode_query_rows: torch.Tensor | None = None
    decode_output_rows: torch.Tensor | None = None
    # What decode_slots / decode_bias are made from, for the windowed views of sliding-window layers:
    # the decodes' block tables [num_decodes, longest], first query positions and query counts.
    decode_tables: torch.Tensor | None = None
    decode_starts: torch.Tensor | None = None
    decode_counts: torch.Tensor | None = None
    block_size: int = 0
    _windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def decode_context(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, bias) of the decodes' contexts: decode_slots / decode_bias, or with a window only the
        positions some query of the decode sees (made at the first layer that asks, then reused)."""
        if window is None:
            assert self.decode_slots is not None and self.decode_bias is not None, "asked only of decodes"
            return self.decode_slots, self.decode_bias
        if window not in self._windowed:
            assert self.decode_tables is not None and self.decode_starts is not None and self.decode_counts is not None
            slots, bias = decode_context(
                self.decode_tables, self.decode_starts, self.decode_counts, self.decode_queries, self.block_size, window
            )
            self._windowed[window] = slots.to(self.slot_mapping.device), bias.to(self.slot_mapping.device)
        return self._windowed[window]


@dataclass(eq=False)
class _ChunkBuffer:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    filled: int = 0  # leading positions holding valid K/V


class TorchMetadataBuilder(MetadataBuilder):
    def __init__(self, backend: Backend, kv_caches: list[LayerKV], block_size: int):
        super().__init__(backend, kv_caches, block_size)
        quantized = isinstance(kv_caches[0][0], QuantizedKV)
        # A quantized cache is read back even by a prompt's first chunk (instead of its fresh K/V),
        # so that a prompt computes the same whether its prefix comes from the cache or not.
        self.read_back_first_chunk = quantized
        # Otherwise a long prompt prefilled in chunks keeps a contiguous K/V copy; quantized caches
        # dequantize on read, which the copy would skip.
        self.use_chunk_buffers = not quantized
        self.chunk_buffers: dict[int, _ChunkBuffer] = {}

    def prepare(self, batch: StepBatch, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor, TorchMetadata]:
        """pad_to: a decode-only batch padded with copies of its last decode, which write the same
        K/V into the same slots (its buffers are not persistent: this serves the padding's tests)."""
        if pad_to is not None and pad_to > len(batch.seqs):
            batch = StepBatch(batch.seqs + [batch.seqs[-1]] * (pad_to - len(batch.seqs)), batch.finished_seq_ids)
        for seq_id in batch.finished_seq_ids:
            self.chunk_buffers.pop(seq_id, None)
        input_ids, positions, slot_mapping = self.token_inputs(batch)
        # The sliding-window layers' own block tables, where they have a pool of their own.
        windowed = batch.seqs[0].window_block_table is not None
        tables, window_tables, starts, counts = [], [], [], []  # of the decodes, which read by block table
        prefills: list[PrefillSpan] = []
        window_prefills: list[PrefillSpan] = []
        offset = 0
        for s in batch.seqs:
            start, n = s.start, len(s.token_ids)
            if s.is_decode:
                tables.append(s.block_table)
                window_tables.append(s.window_block_table or [])  # all have one when the first has
                starts.append(start)
                counts.append(n)
            else:
                read_back = start > 0 or self.read_back_first_chunk
                slots = self._slots([s.block_table], start + n)[0].to(self.device) if read_back else None
                span = PrefillSpan(offset, offset + n, slots, start)
                buffer = self._chunk_buffer(s)
                if buffer is not None:
                    span.buffer, span.buffer_filled = buffer.kv, buffer.filled
                    buffer.filled = start + n
                    if s.completes:  # the prompt is done: decodes read the paged cache
                        del self.chunk_buffers[s.seq_id]
                prefills.append(span)
                if windowed:  # the same chunk (and contiguous copy: its layers are disjoint), other slots
                    slots = (
                        self._slots([s.window_block_table or []], start + n)[0].to(self.device) if read_back else None
                    )
                    window_prefills.append(dataclasses.replace(span, context_slots=slots))
            offset += n
        meta = TorchMetadata(
            backend=self.backend, slot_mapping=slot_mapping, num_decode_tokens=sum(counts), prefills=prefills
        )
        if tables:
            self._decode_metadata(meta, tables, starts, counts)
        if windowed:
            meta.sliding = TorchMetadata(
                backend=self.backend,
                slot_mapping=self.slot_mapping(batch, [s.window_block_table or [] for s in batch.seqs]),
                num_decode_tokens=meta.num_decode_tokens,
                prefills=window_prefills,
            )
            if tables:
                # Its layers read only their windows (TorchMetadata.decode_context), never whole contexts.
                self._decode_metadata(meta.sliding, window_tables, starts, counts, whole_contexts=False)
        return input_ids, positions, meta

    def _chunk_buffer(self, s: ScheduledSeq) -> _ChunkBuffer | None:
        """The contiguous K/V copy for a long prompt prefilled in several chunks (created at its
        first chunk, or when a chunk starts before the copy's end: the sequence was preempted and
        is recomputed)."""
        if not self.use_chunk_buffers or s.seq_len < CHUNK_BUFFER_MIN_TOKENS or (s.start == 0 and s.completes):
            return None
        buffer = self.chunk_buffers.get(s.seq_id)
        if buffer is None or buffer.filled > s.start or buffer.kv.shape[3] < s.seq_len:
            k_cache = self.kv_caches[0][0]
            assert isinstance(k_cache, torch.Tensor), "chunk buffers are off for quantized caches"
            layers, kv_heads, head_dim = len(self.kv_caches), k_cache.shape[2], k_cache.shape[3]
            kv = torch.empty(layers, 2, kv_heads, s.seq_len, head_dim, dtype=k_cache.dtype, device=self.device)
            buffer = self.chunk_buffers[s.seq_id] = _ChunkBuffer(kv)
        return buffer

    def _slots(self, block_tables: list[list[int]], num_slots: int) -> torch.Tensor:
        """Flat cache slots of positions [0, num_slots) for each block table, as [len(tables), num_slots]."""
        bs = self.block_size
        width = -(-num_slots // bs)
        table = torch.tensor([bt[:width] + [0] * (width - len(bt[:width])) for bt in block_tables], dtype=torch.long)
        slots = table.unsqueeze(-1) * bs + torch.arange(bs)
        return slots.view(len(block_tables), -1)[:, :num_slots]

    def _decode_metadata(
        self,
        meta: TorchMetadata,
        tables: list[list[int]],
        starts: list[int],
        counts: list[int],
        whole_contexts: bool = True,
    ) -> None:
        """Context slots and masks of the decodes (with whole_contexts; otherwise only what their windowed
        views are made from); query j of a decode starting at position p sees positions <= p + j
        (padding queries repeat the decode's last one)."""
        queries = max(counts)
        starts_t, counts_t = torch.tensor(starts), torch.tensor(counts)
        width = max(len(t) for t in tables)
        meta.decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        meta.decode_starts, meta.decode_counts, meta.block_size = starts_t, counts_t, self.block_size
        if whole_contexts:
            slots, bias = decode_context(meta.decode_tables, starts_t, counts_t, queries, self.block_size, None)
            meta.decode_slots, meta.decode_bias = slots.to(self.device), bias.to(self.device)
        meta.decode_queries = queries
        j = torch.arange(queries).unsqueeze(0)
        if min(counts) != queries:
            first_row = counts_t.cumsum(0) - counts_t
            padded = first_row.unsqueeze(1) + torch.minimum(j, counts_t.unsqueeze(1) - 1)
            real = (j < counts_t.unsqueeze(1)).flatten()
            meta.decode_query_rows = padded.flatten().to(self.device)
            meta.decode_output_rows = torch.arange(len(tables) * queries)[real].to(self.device)


def decode_context(
    tables: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, queries: int, block_size: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots [B, T] of the positions the decodes read, from the first one a query of the
    decode sees (0, or the start of its first query's window), padded; and the bias [B, 1, queries,
    1, T]: 0 where query j (at position start + j; padding queries repeat the last) sees the slot,
    else -inf."""
    ends = starts + counts
    first = torch.zeros_like(starts) if window is None else (starts - window + 1).clamp(min=0)
    width = int((ends - first).max())
    positions = first.unsqueeze(1) + torch.arange(width)  # [B, T]
    real = positions < ends.unsqueeze(1)
    positions = torch.where(real, positions, 0)
    slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
    j = torch.arange(queries).unsqueeze(0)
    query_pos = (starts.unsqueeze(1) + torch.minimum(j, counts.unsqueeze(1) - 1)).unsqueeze(-1)  # [B, queries, 1]
    key_pos = positions.unsqueeze(1)  # [B, 1, T]
    hidden = (key_pos > query_pos) | ~real.unsqueeze(1)
    if window is not None:
        hidden |= key_pos <= query_pos - window
    bias = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    return slots, bias.view(len(tables), 1, queries, 1, width)


@register_backend
class TorchBackend(Backend):
    name = "torch"
    description = "portable PyTorch ops"

    def metadata_builder(self, kv_caches: list[LayerKV], block_size: int) -> TorchMetadataBuilder:
        return TorchMetadataBuilder(self, kv_caches, block_size)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKV,
        meta: TorchMetadata,  # type: ignore[override]  # a backend gets the metadata its own builder made
        scale: float,
        layer: int,
        window: int | None = None,
    ) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, scale, layer, window)


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor | QuantizedKV,  # [blocks, block_size, kv_heads, head_dim], or quantized storage
    v_cache: torch.Tensor | QuantizedKV,
    meta: TorchMetadata,
    scale: float,
    layer: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    head_dim = q.shape[2]
    num_kv_heads = k.shape[1]
    k_flat = kv_flat(k_cache, num_kv_heads, head_dim)
    v_flat = kv_flat(v_cache, num_kv_heads, head_dim)
    kv_write(k_flat, meta.slot_mapping, k)
    kv_write(v_flat, meta.slot_mapping, v)

    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode_attention(q, k_flat, v_flat, meta, num_kv_heads, scale, window)

    for span in meta.prefills:
        qs = q[span.start : span.end]
        # The chunk's first key: the start of its first query's window.
        key_start = 0 if window is None else max(0, span.num_cached - window + 1)
        if span.buffer is not None:
            assert isinstance(k_flat, torch.Tensor) and isinstance(v_flat, torch.Tensor), "off for quantized caches"
            kh, vh = _append_to_buffer(span, layer, k, v, k_flat, v_flat, key_start)
            kh, vh = kh[:, key_start:], vh[:, key_start:]
            out[span.start : span.end] = _causal_head_major(qs, kh, vh, span.num_cached, scale, window, key_start)
            continue
        if span.context_slots is None:
            ks, vs, key_start = k[span.start : span.end], v[span.start : span.end], 0
        else:
            ks = kv_read(k_flat, span.context_slots[key_start:], q.dtype)
            vs = kv_read(v_flat, span.context_slots[key_start:], q.dtype)
        out[span.start : span.end] = causal_attention(qs, ks, vs, span.num_cached, scale, window, key_start)
    return out


def _append_to_buffer(
    span: PrefillSpan,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    key_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes this chunk's K/V (and, the first time, the cached context from `key_start` on: a
    sliding-window layer's chunks never look before it) into the sequence's contiguous buffer;
    returns head-major views of its whole context."""
    assert span.buffer is not None, "called for spans prefilled through a buffer"
    kb, vb = span.buffer[layer, 0], span.buffer[layer, 1]
    end = span.num_cached + span.end - span.start
    begin = max(span.buffer_filled, key_start)
    if begin < span.num_cached:
        # Cached context not yet in the buffer: its slots are set whenever there is some.
        assert span.context_slots is not None, "a span with cached context reads it back by its slots"
        slots = span.context_slots[begin : span.num_cached]
        kb[:, begin : span.num_cached] = k_flat[slots].transpose(0, 1)
        vb[:, begin : span.num_cached] = v_flat[slots].transpose(0, 1)
    kb[:, span.num_cached : end] = k[span.start : span.end].transpose(0, 1)
    vb[:, span.num_cached : end] = v[span.start : span.end].transpose(0, 1)
    return kb[:, :end], vb[:, :end]


def _decode_attention(
    q: torch.Tensor,
    k_flat: torch.Tensor | QuantizedKV,
    v_flat: torch.Tensor | QuantizedKV,
    meta: TorchMetadata,
    num_kv_heads: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    slots, bias = meta.decode_context(window)
    batch, queries = slots.shape[0], meta.decode_queries
    # Head-major copies ([B, kvh, T, hd]) make both matmuls run on contiguous matrices, which is
    # faster (measurements: docs/design_measurements.md#attention-paths).
    kc = kv_read(k_flat, slots, q.dtype).transpose(1, 2).contiguous()
    vc = kv_read(v_flat, slots, q.dtype).transpose(1, 2).contiguous()
    qd = q[: meta.num_decode_tokens] if meta.decode_query_rows is None else q.index_select(0, meta.decode_query_rows)
    # Query head h reads KV head h // group, so heads are grouped kv-major; a decode's queries and
    # groups share one matrix row range. Scaling the few query values is cheaper than the scores.
    qd = qd.view(batch, queries, num_kv_heads, group, head_dim)
    if queries > 1:
        qd = qd.transpose(1, 2)
    qd = qd.reshape(batch, num_kv_heads, queries * group, head_dim) * scale
    scores = torch.matmul(qd, kc.transpose(2, 3)).float()  # [B, kvh, queries * group, T]
    scores = scores.view(batch, num_kv_heads, queries, group, -1) + bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(batch, num_kv_heads, queries * group, -1)
    o = torch.matmul(probs, vc).view(batch, num_kv_heads, queries, group, head_dim)
    if queries > 1:
        o = o.transpose(1, 2)
    o = o.reshape(batch * queries, num_heads, head_dim)
    return o if meta.decode_output_rows is None else o.index_select(0, meta.decode_output_rows)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_cached: int,
    scale: float,
    window: int | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """q: [L, heads, hd] at positions num_cached .. num_cached + L - 1; k, v: [num_cached + L - key_start,
    kv_heads, hd], the keys from position key_start on. Query i sees keys j <= num_cached + i (and, with a
    window, j > num_cached + i - window). Each query tile reads only the keys it can see."""
    # [kvh, T, hd]: contiguous matrices for the matmuls
    kh, vh = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    return _causal_head_major(q, kh, vh, num_cached, scale, window, key_start)


def _causal_head_major(
    q: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    num_cached: int,
    scale: float,
    window: int | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """causal_attention with K/V given head-major: kh, vh [kv_heads, num_cached + L - key_start, hd]."""
    length, num_heads, head_dim = q.shape
    num_kv_heads = kh.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i0 in range(0, length, QUERY_TILE):
        i1 = min(i0 + QUERY_TILE, length)
        rows, first, visible = (i1 - i0) * group, num_cached + i0, num_cached + i1
        lowest = key_start if window is None else max(key_start, first - window + 1)  # the tile's first key
        # Rows ordered (query, group) so that row r is query i0 + r // group of its KV head.
        qt = q[i0:i1].view(i1 - i0, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, rows, head_dim)
        keys = kh[:, lowest - key_start : visible - key_start]
        scores = torch.matmul(qt * scale, keys.transpose(1, 2)).float()  # [kvh, rows, visible - lowest]
        positions = torch.arange(first, visible, device=q.device).repeat_interleave(group).unsqueeze(1)
        if window is None:
            # Keys before the tile's first query are visible to all its rows: only the tail needs a mask.
            future = torch.arange(first, visible, device=q.device).unsqueeze(0) > positions
            scores[..., first - lowest :].masked_fill_(future, float("-inf"))
        else:
            key_pos = torch.arange(lowest, visible, device=q.device).unsqueeze(0)
            scores.masked_fill_((key_pos > positions) | (key_pos <= positions - window), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, vh[:, lowest - key_start : visible - key_start])  # [kvh, rows, hd]
        out[i0:i1] = (
            o.view(num_kv_heads, i1 - i0, group, head_dim).transpose(0, 1).reshape(i1 - i0, num_heads, head_dim)
        )
    return out
