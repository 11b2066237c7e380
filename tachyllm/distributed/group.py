"""The process group of one tensor-parallel engine: its rank and size, and the two collectives the
sharded model joins (a sum over ranks, and the vocabulary shards of the logits gathered on rank 0).
On the CPU the sums go through shared memory when the engine has a file for it (shm_allreduce.py),
gloo taking what does not fit; the rest is gloo's (NCCL's on CUDA).

A group object of its own (ProcessGroupGloo / ProcessGroupNCCL over a FileStore) rather than
torch.distributed's global default group: several engines may then live in one process (the tests
keep a few), and starting one never touches state another owns."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tachyllm.distributed import shm_allreduce
from tachyllm.distributed.shm_allreduce import ShmAllReduce

# Bounded waits: a collective whose peer never arrives fails after this long instead of hanging. The
# ranks of a step arrive at its collectives together; idle time between steps is spent outside them.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(eq=False)
class TPGroup:
    rank: int
    size: int
    pg: Any  # a ProcessGroupNCCL or ProcessGroupGloo: torch's stubs type collectives on ProcessGroup only
    shm: ShmAllReduce | None = None

    @classmethod
    def join(
        cls,
        store_path: str,
        rank: int,
        size: int,
        device: torch.device,
        shm_path: str | None = None,
        peers_gone: Callable[[], str | None] | None = None,
    ) -> TPGroup:
        """Blocks until every rank has joined (the store is a file all ranks of one engine name).
        shm_path: the shared-memory all-reduce's file (rank 0 created it), whose name rank 0 removes
        once the group has formed; peers_gone: why a peer is gone, or None (see ShmAllReduce)."""
        shm = None
        if shm_path is not None:
            # Mapped before the rendezvous: once it is over, every rank holds the mapping.
            shm = ShmAllReduce.attach(shm_path, rank, size, COLLECTIVE_TIMEOUT_S, peers_gone or (lambda: None))
        store = dist.FileStore(store_path, size)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg: dist.ProcessGroupNCCL | dist.ProcessGroupGloo = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        if shm_path is not None and rank == 0:
            shm_allreduce.remove(shm_path)
        return cls(rank, size, pg, shm)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place."""
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        self.pg.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of every rank's x, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # torch types the enum's members apart
        self.pg.allreduce([x], opts).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """On rank 0: every rank's x concatenated along the last dimension, in rank order; on the other
        ranks x itself (they never read it)."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        x = x.contiguous()
        if self.rank != 0:
            self.pg.gather([], [x], opts).wait()
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.gather([parts], [x], opts).wait()
        return torch.cat(parts, dim=-1)
