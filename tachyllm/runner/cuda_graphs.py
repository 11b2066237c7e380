"""CUDA graphs for decode-only steps: one forward per batch-size bucket (1, 2, 4, 8, then multiples
of 8 up to max_num_seqs, as vLLM) and per number of queries per sequence (1, and 1 + k for
verification steps of a speculator's fixed k), captured at start-up and replayed, so that a step
costs one graph launch instead of a few hundred kernel launches.

A step is padded to its bucket by the backend's MetadataBuilder (`prepare(batch, pad_to=bucket)`);
a backend that is `graph_capturable` writes a decode-only step's input ids, positions and metadata
into the same tensors every time, with shapes that depend only on the bucket and the queries per
sequence: the captured kernels read those addresses. Steps with a prefill chunk, mixed
query counts or more sequences than the largest bucket run eagerly.

`DecodeGraphs(capture=False)` pads and runs the same forward eagerly: the padding logic on a
device without graphs (the tests on the CPU).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from tachyllm.backends.base import AttentionMetadata, Backend, LayerKV, MetadataBuilder
from tachyllm.step import ScheduledSeq, StepBatch

logger = logging.getLogger("tachyllm")

# (input ids, positions, kv caches, metadata) -> hidden states [tokens, hidden]: the model's forward.
Forward = Callable[..., torch.Tensor]
StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]  # input ids, positions, metadata


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 8 below max_num_seqs, and max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    return [b for b in (1, 2, 4, *range(8, max_num_seqs, 8)) if b < max_num_seqs] + [max_num_seqs]


def dummy_decodes(num_seqs: int, queries: int, block_size: int) -> StepBatch:
    """A decode-only batch of `num_seqs` sequences at position 0 with `queries` tokens each (the
    last queries - 1 drafts), all in block 0: what capture runs. Its K/V lands in block 0, which
    nothing owns at start-up and a sequence that gets it overwrites before reading."""
    blocks = [0] * -(-queries // block_size)
    seqs = [
        ScheduledSeq(
            seq_id=-1 - i,
            request_id="",
            start=0,
            token_ids=[0] * queries,
            num_draft_tokens=queries - 1,
            block_table=blocks,
            seq_len=1,
            completes=True,
        )  # fmt: skip
        for i in range(num_seqs)
    ]
    return StepBatch(seqs)


@dataclasses.dataclass(eq=False)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, torch.Tensor, AttentionMetadata]
    output: torch.Tensor


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        builder: MetadataBuilder,
        kv_caches: list[LayerKV],
        max_num_seqs: int,
        max_blocks: int,
        query_counts: tuple[int, ...] = (1,),
        capture: bool = True,
    ):
        self.forward = forward
        self.builder = builder
        # One set of buffers for every query count: a step of fewer queries per sequence is padded
        # with token rows of no sequence.
        builder.allocate_graph_buffers(max_num_seqs, max_blocks, max(query_counts))
        self.kv_caches = kv_caches
        self.buckets = graph_buckets(max_num_seqs)
        self.query_counts = query_counts
        self.capture = capture
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0  # steps run through a bucket (tests, logs)

    def bucket(self, batch: StepBatch) -> tuple[int, int] | None:
        """(bucket, queries per sequence) the step runs in, or None when it runs eagerly."""
        seqs = batch.seqs
        if not seqs or len(seqs) > self.buckets[-1]:
            return None
        queries = len(seqs[0].token_ids)
        if queries not in self.query_counts or not all(s.is_decode and len(s.token_ids) == queries for s in seqs):
            return None
        return self.buckets[bisect.bisect_left(self.buckets, len(seqs))], queries

    @torch.inference_mode()
    def capture_all(self) -> tuple[float, int]:
        """Captures every (bucket, queries) graph, largest first so that smaller ones reuse the
        shared memory pool; returns the seconds and the bytes of device memory it took (nothing
        to do without capture)."""
        if not self.capture:
            return 0.0, 0
        t0 = time.perf_counter()
        device = self.builder.device
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        for queries in self.query_counts:
            for size in reversed(self.buckets):
                self.graphs[size, queries] = self._capture(size, queries, pool)
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0, torch.cuda.memory_reserved(device) - before

    def describe(self) -> str:
        return (
            f"{len(self.graphs)} (batch sizes {_ranges(self.buckets)} x queries per sequence {list(self.query_counts)})"
        )

    def _capture(self, size: int, queries: int, pool: torch.cuda._POOL_HANDLE) -> _Graph:
        device = self.builder.device
        inputs = self.builder.prepare(dummy_decodes(size, queries, self.builder.block_size), pad_to=size)
        # One eager run first, on a side stream as capture needs: lazy initialisation (cuBLAS
        # workspaces, Triton compilation and autotuning) must not happen inside the capture.
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self.forward(*inputs[:2], self.kv_caches, inputs[2])
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = self.forward(*inputs[:2], self.kv_caches, inputs[2])
        return _Graph(graph, inputs, output)

    def prepare(self, batch: StepBatch, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's inputs padded to its bucket."""
        return self.builder.prepare(batch, pad_to=key[0])

    def replay(self, key: tuple[int, int], inputs: StepInputs) -> torch.Tensor:
        """Hidden states of the padded step (the real tokens first): the bucket's graph replayed, or
        without graphs the forward run eagerly. The graph's output is overwritten by its next replay."""
        self.replays += 1
        if not self.capture:
            return self.forward(*inputs[:2], self.kv_caches, inputs[2])
        entry = self.graphs[key]
        _copy_into(entry.inputs, inputs)
        entry.graph.replay()
        return entry.output


def _copy_into(static: StepInputs, fresh: StepInputs) -> None:
    """Copies the tensors of a step's (ids, positions, metadata) into the captured ones, where the
    builder did not already write them in place (a persistent-buffer builder returns views of the
    same memory: nothing is copied). Scalars the capture baked in must not have changed."""
    pairs = [("input_ids", static[0], fresh[0]), ("positions", static[1], fresh[1])]
    pairs += [(f.name, getattr(static[2], f.name), getattr(fresh[2], f.name)) for f in dataclasses.fields(static[2])]
    for name, old, new in pairs:
        if isinstance(old, torch.Tensor):
            if not isinstance(new, torch.Tensor) or new.shape != old.shape or new.dtype != old.dtype:
                raise RuntimeError(
                    f"the metadata builder changed the captured buffer {name!r}: a graph cannot replay it"
                )
            if new.data_ptr() != old.data_ptr():
                old.copy_(new, non_blocking=True)
        elif isinstance(old, (bool, int, float)) and new != old:
            raise RuntimeError(
                f"the metadata builder changed {name!r} ({old} at capture, {new} now): a graph baked it in"
            )


def measure_graph_memory(
    forward: Forward, backend: Backend, allocate_cache: Callable[[int], list[LayerKV]], block_size: int,
    max_num_seqs: int, max_blocks: int, query_counts: tuple[int, ...],
) -> int:  # fmt: skip
    """Bytes the graphs' memory pool takes, measured before the KV cache is sized: the largest bucket
    of each query count captured against a one-block cache, then freed (smaller buckets reuse the
    shared pool, so the largest ones bound it)."""
    device = backend.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    caches = allocate_cache(1)
    cache_bytes = torch.cuda.memory_reserved(device) - before
    builder = backend.metadata_builder(caches, block_size)
    graphs = DecodeGraphs(forward, builder, caches, max_num_seqs, max_blocks, query_counts)
    graphs.buckets = graphs.buckets[-1:]
    seconds, _ = graphs.capture_all()
    used = max(torch.cuda.memory_reserved(device) - before - cache_bytes, 0)
    logger.info(
        "CUDA graphs: a trial capture of %s took %.1f s and %.0f MiB, kept free of the KV cache",
        graphs.describe(), seconds, used / 2**20,
    )  # fmt: skip
    del graphs, builder, caches
    torch.cuda.empty_cache()
    return used


def _ranges(buckets: list[int]) -> str:
    return f"{buckets[0]}..{buckets[-1]}" if len(buckets) > 5 else str(buckets)
