"""A tensor-parallel worker process (ranks 1..N-1): joins the group, builds its shard of the model,
allocates its KV cache with the number of blocks the driver chose, then runs its share of every step
the driver sends, until the driver says stop or goes away.

The driver talks to it over a pipe: start-up messages up, the step's plain-data batch down (a
StepBatch without its sampling inputs, which only rank 0 reads). The pipe is also how a worker
outlives nothing: its end closes when the driver exits, however it exits, and a blocked recv() then
ends the loop; a worker inside a collective whose driver died gets gloo's connection error instead,
or, waiting in the shared-memory all-reduce, finds that its parent is no longer the driver.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from tachyllm.config import EngineConfig
from tachyllm.host_malloc import keep_freed_memory, use_one_arena

# A worker is a spawned interpreter, which imports the driver's main module before it runs anything.
# When that module starts a tensor-parallel engine at import time (a script without a main guard),
# the worker exits with this status, which the driver turns into UNGUARDED_MAIN.
UNGUARDED_MAIN_EXIT_CODE = 3
UNGUARDED_MAIN = (
    "the script that starts the engine has no main guard, and each worker process imports it again: "
    'put the code that starts the engine under `if __name__ == "__main__":`'
)


@dataclass
class WorkerSpec:
    """What a worker is told at spawn (plain, picklable data)."""

    config: EngineConfig
    rank: int
    size: int
    store_path: str  # the group's rendezvous file
    shm_path: str | None  # the shared-memory all-reduce's file, or None: gloo's
    threads: int
    cpus: list[int] | None  # pinned to these, or None
    max_model_len: int


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process's entry point (torch.multiprocessing spawn). Ends with os._exit: tearing
    down an interpreter that holds a process group takes seconds, and there is nothing to save."""
    code = _serve(spec, conn)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_if_importing_main() -> None:
    """Called where a tensor-parallel engine starts: in a worker still importing the driver's main
    module, that module has no main guard. multiprocessing would fail the worker with a page of advice
    on its stderr, and the driver see only "exited with code 1"; the worker leaves quietly instead,
    with a status that tells the driver why."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # what multiprocessing checks
        raise SystemExit(UNGUARDED_MAIN_EXIT_CODE)


def _serve(spec: WorkerSpec, conn: Connection) -> int:
    """Runs the worker; returns its exit code."""
    try:
        runner = _start(spec, conn)
    except Exception as exc:
        traceback.print_exc()
        _send(conn, ("error", one_line(exc)))
        return 1
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return 1
        if batch is None:  # shut down
            return 0
        try:
            runner.execute_shard(batch)
        except Exception as exc:  # the group cannot go on without this rank: say why, then exit
            traceback.print_exc()
            _send(conn, ("error", one_line(exc)))
            return 1


def _start(spec: WorkerSpec, conn: Connection):
    # Imported here: the spawned interpreter pays for them once the pipe is up.
    from tachyllm.backends import create_backend
    from tachyllm.distributed.group import TPGroup
    from tachyllm.distributed.sharding import ShardPlan, build_rank_model
    from tachyllm.loading import load_checkpoint
    from tachyllm.runner.model_runner import ModelRunner

    config = spec.config
    use_one_arena()
    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)
    torch.set_num_threads(spec.threads)
    device = rank_device(config.device, spec.rank)
    conn.send(("hello",))  # up: the driver may now wait in the rendezvous
    group = TPGroup.join(spec.store_path, spec.rank, spec.size, device, spec.shm_path, _driver_gone(os.getppid()))
    ckpt = load_checkpoint(config.model)
    backend = create_backend(config.backend, device)
    plan = ShardPlan(ckpt.config, spec.rank, spec.size)
    model, _ = build_rank_model(ckpt, plan, group, config, backend, spec.max_model_len)
    conn.send(("loaded",))
    num_blocks = conn.recv()
    caches = backend.allocate_kv_cache(plan.config, num_blocks, config.block_size, config.resolve_dtype())
    keep_freed_memory()
    conn.send(("ready",))
    return ModelRunner(model, caches, config.block_size, None, backend)


def _driver_gone(driver: int) -> Callable[[], str | None]:
    """Whether the driver (this process's parent) has exited: the orphan is then adopted by another."""
    return lambda: None if os.getppid() == driver else f"the driver (rank 0, pid {driver}) exited"


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a CUDA engine runs on GPU r; CPU ranks share the CPU (see tp_cpu_binding)."""
    return torch.device("cuda", rank) if device.startswith("cuda") else torch.device(device)


def _send(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except OSError:  # the driver is gone: nobody to tell
        pass
