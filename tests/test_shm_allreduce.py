"""The shared-memory all-reduce of CPU tensor-parallel ranks (distributed/shm_allreduce.py, the op in
kernels/csrc/shm_allreduce.cpp): every rank gets bitwise the rank-order sum, over many calls of
varying sizes and skewed arrival (the double buffer); what does not fit a slot goes to gloo; a peer
that dies while a rank waits fails the call in a moment; no file is left in /dev/shm.

Rank 0 is this process, rank 1 a spawned one (an interpreter importing torch: seconds here)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tachyllm.config import EngineConfig
from tachyllm.distributed import executor as tp_executor
from tachyllm.distributed import shm_allreduce
from tachyllm.distributed.group import TPGroup
from tachyllm.distributed.worker import _driver_gone
from tachyllm.errors import ConfigError, WorkerError
from tachyllm.kernels.native import native_ops

pytestmark = pytest.mark.native

SLOT = 64 << 10  # bytes: 16384 fp32 values
CALLS = 600


def schedule(seed: int = 0) -> list[tuple[int, torch.dtype, int, float]]:
    """(values, dtype, rank that arrives late, by how long) of each call, the same on both ranks.
    Sizes up to just above the slot (those go to gloo); every tenth call one rank is late."""
    rng = random.Random(seed)
    calls = []
    for i in range(CALLS):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        limit = SLOT // dtype.itemsize
        numel = limit + rng.randint(1, 64) if i % 25 == 24 else rng.randint(1, limit)
        calls.append((numel, dtype, rng.randrange(2), rng.uniform(0, 1e-3) if i % 10 == 0 else 0.0))
    return calls


def inputs(call: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(2 * call + rank)
    return (torch.randn(numel, generator=g) * 100).to(dtype)


def run_schedule(group: TPGroup) -> list[str]:
    """Runs every call of the schedule; what went wrong on this rank."""
    errors = []
    for call, (numel, dtype, late, delay) in enumerate(schedule()):
        if late == group.rank and delay:
            time.sleep(delay)
        x = inputs(call, group.rank, numel, dtype)
        seq = group.shm.op.seq
        group.all_reduce(x)
        expected = (inputs(call, 0, numel, dtype).float() + inputs(call, 1, numel, dtype).float()).to(dtype)
        shm_used = group.shm.op.seq == seq + 1
        if not torch.equal(x, expected):
            errors.append(f"call {call} ({numel} x {dtype}): not the rank-order sum")
        if shm_used != (numel * dtype.itemsize <= SLOT):
            errors.append(f"call {call} ({numel} x {dtype}): shared memory used: {shm_used}")
    return errors


def _rank1(store: str, path: str, conn) -> None:
    torch.set_num_threads(1)
    group = TPGroup.join(store, 1, 2, torch.device("cpu"), path)
    while conn.recv():
        conn.send(run_schedule(group))


@contextmanager
def pair():
    """(rank 0's group, rank 1's process, a pipe to it) over a new file, removed once both joined."""
    directory = tempfile.mkdtemp(prefix="tachy-shm-test-")
    path = os.path.join(shm_allreduce.SHM_DIR, os.path.basename(directory))
    shm_allreduce.create(path, 2, SLOT)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_rank1, args=(os.path.join(directory, "store"), path, child), daemon=True)
    process.start()
    try:
        gone = lambda: None if process.is_alive() else "rank 1 exited"  # noqa: E731
        group = TPGroup.join(os.path.join(directory, "store"), 0, 2, torch.device("cpu"), path, gone)
        assert not os.path.exists(path)  # removed by rank 0 once the group formed
        yield group, process, conn
    finally:
        process.kill()
        process.join()
        conn.close()
        shm_allreduce.remove(path)
        shutil.rmtree(directory, ignore_errors=True)


def test_every_rank_gets_the_rank_order_sum_bitwise_and_large_tensors_go_to_gloo():
    with pair() as (group, process, conn):
        conn.send(True)
        assert run_schedule(group) == []
        assert conn.recv() == []
        assert group.shm.op.seq == sum(n * d.itemsize <= SLOT for n, d, _, _ in schedule())
        # Neither integers nor strided views: gloo's.
        assert not group.shm.fits(torch.arange(8)) and not group.shm.fits(torch.ones(4, 4).t())


def test_a_peer_killed_mid_wait_fails_the_call_in_a_moment():
    with pair() as (group, process, conn):
        threading.Timer(0.5, process.kill).start()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="shared-memory all-reduce 1: rank 1 exited"):
            group.all_reduce(torch.ones(16))  # rank 1 never comes: it waits for a message
        assert time.monotonic() - t0 < 5


def test_three_ranks_sum_in_rank_order():
    """Three ranks' native halves over one mapping, driven in turn from this process: each result is
    ((x0 + x1) + x2) bitwise (not another order), the same for every rank, through both buffers."""
    ops = native_ops()
    mapping = torch.zeros(ops.ShmAllReduce.mapping_bytes(3, 256), dtype=torch.uint8)
    ranks = [ops.ShmAllReduce(mapping, r, 3) for r in range(3)]
    assert ranks[0].slot_bytes == 256
    for call in range(4):
        # x0 + x1 cancels exactly; x1 + x2 first would lose x2's low bits.
        big = torch.randn(64) * 1e8
        xs = [big, -big, torch.randn(64)]
        outs = [x.clone() for x in xs]
        for rank, out in zip(ranks, outs):
            rank.publish(out)
        for rank, out in zip(ranks, outs):
            assert rank.reduce(out, 1.0)
        expected = (xs[0] + xs[1]) + xs[2]
        assert all(torch.equal(out, expected) for out in outs)
        assert not torch.equal(expected, xs[0] + (xs[1] + xs[2]))
        assert ranks[0].seq == call + 1


def test_unset_uses_shm_where_it_can_asked_for_fails_without_it(monkeypatch, caplog):
    ckpt = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    missing = "/nonexistent-dir/tachy-tp-x"
    assert not tp_executor._create_shm(EngineConfig(tensor_parallel_size=2), ckpt, missing)
    assert "gloo's all-reduce, no shared memory" in caplog.text
    with pytest.raises(ConfigError, match="tp_all_reduce='shm': no shared memory for it"):
        tp_executor._create_shm(EngineConfig(tensor_parallel_size=2, tp_all_reduce="shm"), ckpt, missing)
    assert not tp_executor._create_shm(EngineConfig(tensor_parallel_size=2, tp_all_reduce="gloo"), ckpt, missing)
    with pytest.raises(ConfigError, match="tp_all_reduce='shm' is for CPU ranks"):
        EngineConfig(device="cuda", tp_all_reduce="shm")
    with pytest.raises(ConfigError, match="tp_all_reduce must be shm or gloo"):
        EngineConfig(tp_all_reduce="nccl")


def test_a_worker_sees_its_driver_gone_when_it_is_no_longer_its_parent():
    assert _driver_gone(os.getppid())() is None
    assert _driver_gone(1 << 30)() == f"the driver (rank 0, pid {1 << 30}) exited"
