"""The sum over the tensor-parallel ranks of one CPU host through shared memory, instead of gloo's
all-reduce: gloo sends every call through loopback sockets (about 1 ms each, measured on a quiet host:
docs/benchmarks.md#tensor-parallelism), and a decode step makes two per layer. vLLM's and SGLang's CPU backends have one
for the same reason.

Rank 0 creates the file (under /dev/shm) before its workers start; every rank maps it before joining
the process group, and rank 0 removes its name once the group has formed (`TPGroup.join`), so that
nothing is left in /dev/shm however the processes end. The reduce itself is the C++ op
(kernels/csrc/shm_allreduce.cpp: layout, ordering, why two buffers suffice): each call publishes the
rank's tensor, then waits for every peer in short native waits, between which it checks that the
peers still live and that the collective timeout has not passed, so that a dead peer fails the step
in a moment instead of hanging it.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tachyllm.errors import WorkerError
from tachyllm.kernels.native import native_ops

SHM_DIR = "/dev/shm"
# A slot holds at most this much: a step's largest all-reduce (its token budget x hidden size) when
# that is smaller. Decode steps (up to max_num_seqs x hidden) fit; only long prefill chunks of large
# models go to gloo, whose fixed per-call cost is then small against the bytes moved. It also keeps the file
# (2 x ranks slots) within a container's /dev/shm, often 64 MiB.
SLOT_BYTES_MAX = 4 << 20
# Each native wait spins this long; between two, the peers' liveness and the timeout are checked.
WAIT_SLICE_S = 0.02
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def create(path: str, size: int, slot_bytes: int) -> None:
    """Creates the group's file with slots of `slot_bytes` (the largest all-reduce a step makes),
    at most SLOT_BYTES_MAX, its pages reserved (a full /dev/shm fails here with OSError rather
    than with a SIGBUS at the first write) and zeroed (no rank has published)."""
    ops = native_ops()
    if ops is None:
        raise OSError("the C++ kernels are not built")
    total = ops.ShmAllReduce.mapping_bytes(size, min(slot_bytes, SLOT_BYTES_MAX))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(eq=False)
class ShmAllReduce:
    """One rank's side of the shared-memory all-reduce."""

    op: Any  # the native ShmAllReduce over this rank's mapping (an untyped extension object)
    timeout_s: float
    # Why a peer is gone (one line), or None while all live; checked between native waits.
    peers_gone: Callable[[], str | None]

    @classmethod
    def attach(cls, path: str, rank: int, size: int, timeout_s: float, peers_gone: Callable[[], str | None]):
        ops = native_ops()
        if ops is None:
            raise WorkerError("shared-memory all-reduce: the C++ kernels are not built on this rank")
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, 0)
        finally:
            os.close(fd)  # the mapping stays
        return cls(ops.ShmAllReduce(torch.frombuffer(mapping, dtype=torch.uint8), rank, size), timeout_s, peers_gone)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x goes through shared memory (every rank decides alike: the ranks' tensors agree in
        shape and dtype); the rest goes to gloo."""
        return x.dtype in DTYPES and x.is_contiguous() and x.nbytes <= self.op.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x in rank order, in place: bitwise the same on every rank."""
        self.op.publish(x)
        start = time.monotonic()
        while not self.op.reduce(x, WAIT_SLICE_S):
            gone = self.peers_gone()
            if gone is not None:
                raise WorkerError(f"shared-memory all-reduce {self.op.seq}: {gone}")
            if time.monotonic() - start > self.timeout_s:
                raise WorkerError(
                    f"shared-memory all-reduce {self.op.seq}: a rank did not arrive in {self.timeout_s:.0f} s"
                )
        return x
