"""The driver's side of tensor parallelism: rank 0 runs in the engine's process, ranks 1..N-1 are
worker processes it spawns (worker.py). To the engine it looks like a ModelRunner: `execute(batch)`
returns the step's StepResult. The scheduler, the sampler and the API stay in the driver; each step
the batch's plain data goes to every worker, all ranks run the forward together (their collectives
meet in the row-parallel layers and the LM head), and rank 0 samples.

Failure: a worker that dies, or any failed step (the ranks' collectives may no longer line up),
stops the whole group and raises WorkerError; the engine fails its requests and shuts down. A worker
that dies between steps is found by check_workers(), which the engine calls between steps, idle or
not. Every wait is bounded (start-up stages, the collectives' timeout), and workers die with the driver.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from functools import partial
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tachyllm.backends.base import Backend, LayerKV
from tachyllm.config import EngineConfig
from tachyllm.distributed import shm_allreduce
from tachyllm.distributed.group import TPGroup
from tachyllm.distributed.sharding import ShardPlan, build_rank_model
from tachyllm.distributed.worker import (
    UNGUARDED_MAIN,
    UNGUARDED_MAIN_EXIT_CODE,
    WorkerSpec,
    one_line,
    rank_device,
    worker_main,
)
from tachyllm.errors import ConfigError, WorkerError
from tachyllm.loading import Checkpoint
from tachyllm.platform import default_threads, usable_cpu_ids
from tachyllm.runner.model_runner import ModelRunner
from tachyllm.sampling.sampler import Sampler
from tachyllm.speculative_config import SpeculativeConfig
from tachyllm.step import StepBatch, StepResult

logger = logging.getLogger("tachyllm")

# A start-up stage (spawn and import, loading the shard, allocating its KV cache) that takes longer
# than this on a worker fails the engine's start.
START_TIMEOUT_S = 600.0
# Grace given to a worker told to stop before it is killed.
STOP_GRACE_S = 5.0
# How long a failed step waits for a worker's death to become visible before blaming rank 0.
DEATH_GRACE_S = 10.0
NUMA_ROOT = Path("/sys/devices/system/node")


@dataclass(eq=False)
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, ckpt: Checkpoint, backend: Backend, max_model_len: int):
        size = config.tensor_parallel_size
        check_supported(config, ckpt)
        self.plan = ShardPlan(ckpt.config, 0, size)  # refuses a model that does not split before anything starts
        self.size = size
        threads = max(1, (config.threads or default_threads()) // size)
        cpus = rank_cpus(size) if config.tp_cpu_binding else [None] * size
        self._dir = tempfile.mkdtemp(prefix="tachy-tp-")
        # The shared-memory all-reduce's file while the group forms (then removed), or None: gloo sums.
        self.shm_path: str | None = os.path.join(shm_allreduce.SHM_DIR, os.path.basename(self._dir))
        self.workers: list[_Worker] = []
        # Stops the workers when shutdown() is not called: on garbage collection or at exit.
        self._stop = weakref.finalize(self, _stop_workers, self.workers, self._dir, self.shm_path)
        self.runner: ModelRunner | None = None
        self.failure: str | None = None
        try:
            if not _create_shm(config, ckpt, self.shm_path):
                self.shm_path = None
            ctx = mp.get_context("spawn")
            store = os.path.join(self._dir, "store")
            for rank in range(1, size):
                spec = WorkerSpec(
                    config=config, rank=rank, size=size, store_path=store, shm_path=self.shm_path, threads=threads,
                    cpus=cpus[rank], max_model_len=max_model_len,
                )  # fmt: skip
                parent, child = ctx.Pipe()
                process = ctx.Process(target=worker_main, args=(spec, child), name=f"tachy-tp-rank{rank}", daemon=True)
                process.start()
                child.close()
                self.workers.append(_Worker(rank, process, parent))
            self._expect("hello")
            if cpus[0] is not None:
                os.sched_setaffinity(0, cpus[0])
            torch.set_num_threads(threads)
            device = rank_device(config.device, 0)
            self.group = TPGroup.join(store, 0, size, device, self.shm_path, partial(_worker_gone, self.workers))
            self.backend = backend
            self.model, self.weight_bytes = build_rank_model(
                ckpt, self.plan, self.group, config, backend, max_model_len
            )
            self._expect("loaded")
        except BaseException:
            self.shutdown()
            raise
        collectives = "NCCL" if config.device.startswith("cuda") else "gloo"
        if self.shm_path is not None:
            collectives = "shared-memory all-reduce, gloo"
        logger.info(
            "tensor parallel: %d ranks (%d thread(s) each%s), %s; the CPU backend's fused decoder layers are off",
            size, threads, ", pinned" if config.tp_cpu_binding else "", collectives,
        )  # fmt: skip

    def start(self, caches: list[LayerKV], num_blocks: int, block_size: int, sampler: Sampler) -> None:
        """Every rank allocates the same number of KV blocks (rank 0's `caches`); then steps may run."""
        for w in self.workers:
            w.conn.send(num_blocks)
        self._expect("ready")
        self.runner = ModelRunner(self.model, caches, block_size, sampler, self.backend)

    def execute(self, batch: StepBatch) -> StepResult:
        if self.failure is not None:
            raise WorkerError(self.failure)
        # Only rank 0 samples: the workers get the step without its sampling inputs (generators, bitmasks).
        message = StepBatch([replace(s, sampling=None) for s in batch.seqs], batch.finished_seq_ids)
        try:
            for w in self.workers:
                w.conn.send(message)
            assert self.runner is not None, "start() made rank 0's runner"
            return self.runner.execute(batch)
        except Exception as exc:
            # The ranks may be out of step now (one left a collective the others wait in): stop them all.
            self.failure = self._dead_worker() or f"tensor-parallel step failed on rank 0 ({one_line(exc)})"
            self.shutdown()
            raise WorkerError(self.failure) from exc

    def check_workers(self) -> str | None:
        """Between steps: why the group can no longer run (self.failure), noticing first a worker that
        died while no step ran (the others are then stopped, as after a failed step); None while all live."""
        stopped = not self._stop.alive  # shut down on purpose: its workers ended as they were told
        if self.failure is None and not stopped and wait([w.process.sentinel for w in self.workers], timeout=0):
            self.failure = self._dead_worker()
            self.shutdown()
        return self.failure

    def shutdown(self) -> None:
        """Stops every worker (killed after a grace period); idempotent."""
        self._stop()

    def _dead_worker(self) -> str | None:
        """Why a worker is gone (its own error message when it sent one), or None while all live."""
        # A killed worker's sockets close (rank 0's collective fails) a moment before its sentinel does,
        # and that a moment before it can be reaped (its exit code known): a loaded host takes a while.
        ended = wait([w.process.sentinel for w in self.workers], timeout=DEATH_GRACE_S)
        for w in self.workers:
            message = _error_message(w)
            if message is None and w.process.sentinel not in ended:
                continue
            deadline = time.monotonic() + DEATH_GRACE_S
            while w.process.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.05)
            code = w.process.exitcode
            why = message or (f"exit code {code}" if code is not None else "its process ended")
            return f"tensor-parallel rank {w.rank} (pid {w.process.pid}) died: {why}"
        return None

    def _expect(self, stage: str) -> None:
        """Waits until every worker reports `stage`; a worker that fails or dies first fails the start,
        in one line."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for w in self.workers:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError(
                        f"tensor-parallel rank {w.rank} did not reach {stage!r} in {START_TIMEOUT_S:.0f} s"
                    )
                ready = wait([w.conn, w.process.sentinel], timeout=left)
                if w.conn in ready:
                    try:
                        message = w.conn.recv()
                    except EOFError:
                        message = ("error", _exit_reason(w))
                    if message[0] == "error":
                        raise WorkerError(f"tensor-parallel rank {w.rank} failed to start: {message[1]}")
                    if message[0] == stage:
                        break
                elif ready:
                    raise WorkerError(f"tensor-parallel rank {w.rank} failed to start: {_exit_reason(w)}")


def _exit_reason(w: _Worker) -> str:
    """Why a worker that ended while starting, without a word, ended."""
    w.process.join(STOP_GRACE_S)
    if w.process.exitcode == UNGUARDED_MAIN_EXIT_CODE:
        return UNGUARDED_MAIN
    return f"exited with code {w.process.exitcode}"


def _error_message(w: _Worker) -> str | None:
    try:
        if w.conn.poll():
            message = w.conn.recv()
            if message[0] == "error":
                return message[1]
    except (EOFError, OSError):
        pass
    return None


def _worker_gone(workers: list[_Worker]) -> str | None:
    """Which worker has exited, or None while all live (the shared-memory all-reduce asks between waits)."""
    for w in workers:
        if not w.process.is_alive():
            return f"tensor-parallel rank {w.rank} (pid {w.process.pid}) exited"
    return None


def _create_shm(config: EngineConfig, ckpt: Checkpoint, path: str) -> bool:
    """Whether the ranks sum over shared memory (its file then created at `path`): on the CPU unless
    tp_all_reduce is gloo. Where it cannot be had, asked for it fails the start, else gloo sums."""
    if config.device.startswith("cuda") or config.tp_all_reduce == "gloo":
        return False
    assert config.max_num_batched_tokens is not None, "EngineConfig.__post_init__ sets it"
    largest = config.max_num_batched_tokens * ckpt.config.hidden_size * config.resolve_dtype().itemsize
    try:
        shm_allreduce.create(path, config.tensor_parallel_size, largest)
    except OSError as exc:
        if config.tp_all_reduce == "shm":
            raise ConfigError(f"tp_all_reduce='shm': no shared memory for it ({one_line(exc)})") from exc
        logger.warning("tensor parallel: gloo's all-reduce, no shared memory for another (%s)", one_line(exc))
        return False
    return True


def _stop_workers(workers: list[_Worker], directory: str, shm_path: str) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()
    shutil.rmtree(directory, ignore_errors=True)
    shm_allreduce.remove(shm_path)  # where the group never formed (once it has, rank 0 removed it)


def check_supported(config: EngineConfig, ckpt: Checkpoint) -> None:
    """What tensor parallelism does not cover yet, refused in one line before anything starts."""
    n = config.tensor_parallel_size
    refusals = [
        (
            ckpt.prequantized is not None,
            f"pre-quantized checkpoints ({ckpt.prequantized.format.method if ckpt.prequantized else ''}: "
            "splitting their stored groups is not built); accepted under TP: int4, int8, gguf",
        ),
        (
            config.quantization in ("awq", "fp8"),
            f"quantization {config.quantization!r} (awq calibrates on the whole model; fp8's per-channel scales "
            "span the inputs o/down split); accepted under TP: int4, int8, gguf",
        ),
        (config.kv_cache_dtype != "auto", f"kv_cache_dtype {config.kv_cache_dtype!r} (its calibration runs the model)"),
        (
            isinstance(config.speculative_config, SpeculativeConfig)
            and (config.speculative_config.model or "").startswith("self:layers="),
            "a draft made of the target's own layers (self:layers=N): use ngram, self:int4 or a draft checkpoint",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"tensor_parallel_size={n} does not support {what}")
    if config.device.startswith("cuda") and torch.cuda.device_count() < n:
        raise ConfigError(f"tensor_parallel_size={n} needs {n} GPUs; {torch.cuda.device_count()} visible")


def rank_cpus(size: int) -> list[list[int]]:
    """The cores each rank is pinned to: one NUMA node per rank where the host has exactly one per
    rank, else the usable cores cut into `size` contiguous shares."""
    usable = usable_cpu_ids()
    nodes = sorted(NUMA_ROOT.glob("node[0-9]*")) if NUMA_ROOT.exists() else []
    if len(nodes) == size:
        shares = [[c for c in _cpu_list((node / "cpulist").read_text()) if c in usable] for node in nodes]
        if all(shares):
            return shares
    if len(usable) < size:
        raise ConfigError(f"tp_cpu_binding: {len(usable)} usable cores cannot give each of {size} ranks its own")
    per = len(usable) // size
    return [usable[r * per : (r + 1) * per] for r in range(size)]


def _cpu_list(text: str) -> list[int]:
    """'0-3,8-11' -> [0, 1, 2, 3, 8, 9, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus += range(int(low), int(high or low) + 1)
    return cpus
