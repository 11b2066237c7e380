"""What this machine gives the engine: the CPUs this process may use (affinity mask, cgroup quota), the
default compute threads and the CPUs they are pinned to, and a warning when other processes keep those
CPUs busy."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger("tachyllm")

# Where the CPU limits are read; module attributes so that tests can point them elsewhere.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _quota(quota: str, period: str) -> float | None:
    """CPUs a CFS quota allows, or None for no limit ("max" in v2, -1 in v1)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_quota() -> float | None:
    """The tightest CPU quota (in CPUs, e.g. 1.5) of this process's cgroup and its parents, as a
    container runtime or Kubernetes `resources.limits.cpu` sets it; None when there is none.
    cgroup v2: `cpu.max` ("QUOTA PERIOD" or "max PERIOD"); v1: cpu.cfs_quota_us / cpu.cfs_period_us."""
    dirs: list[Path] = []
    own = _read(PROC_SELF_CGROUP) or ""
    for line in own.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":  # v2: "0::/path"
            base = CGROUP_ROOT
        elif "cpu" in controllers.split(","):  # v1: "N:cpu,cpuacct:/path"
            mounts = [CGROUP_ROOT / d for d in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (CGROUP_ROOT / d).is_dir()]
            if not mounts:
                continue
            base = mounts[0]
        else:
            continue
        d = base / rel if rel else base
        while True:  # the cgroup and every parent up to the mount point (a container sees its own root)
            dirs.append(d)
            if d == base:
                break
            d = d.parent
    dirs += [CGROUP_ROOT, CGROUP_ROOT / "cpu", CGROUP_ROOT / "cpu,cpuacct"]  # when /proc/self/cgroup is unreadable
    limits = []
    for d in dict.fromkeys(dirs):
        v2 = _read(d / "cpu.max")
        if v2:
            parts = v2.split()
            if len(parts) == 2:
                limits.append(_quota(*parts))
        v1q, v1p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if v1q and v1p:
            limits.append(_quota(v1q, v1p))
    known = [q for q in limits if q is not None]
    return min(known) if known else None


def usable_cpu_ids() -> list[int]:
    """The CPUs of this process's affinity mask, in order (empty where there is none: not on Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def available_cpus() -> int:
    """CPUs this process may use: the affinity mask (taskset, cpusets, `docker --cpuset-cpus`), capped
    by a cgroup CPU quota rounded up (`docker --cpus 1.5`, Kubernetes CPU limits: 2). os.cpu_count()
    counts the machine's CPUs, which is too many inside a container or under taskset."""
    cpus = len(usable_cpu_ids()) or os.cpu_count() or 1  # no affinity mask: not on Linux
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota - 1e-6))
    return max(1, cpus)


def default_threads() -> int:
    """OMP_NUM_THREADS if set, else every CPU this process may use (available_cpus). Warns when other
    processes already keep the cores busy (warn_if_busy)."""
    env = os.environ.get("OMP_NUM_THREADS")
    threads = int(env) if env and env.isdigit() and int(env) > 0 else available_cpus()
    warn_if_busy(threads)
    return threads


def compute_thread_cpus(mode: str, threads: int) -> list[int]:
    """The CPU of each compute thread, in OpenMP team order, for --omp-threads-bind (empty: pin none).
    kernels/native.bind_team_threads pins all but the first, the calling thread, which the scheduler then
    keeps on the CPU they leave. "auto" pins only when the engine runs a thread on every CPU this process
    may use: with fewer (--threads below the CPU count, replicas, a cgroup quota below the mask) the CPUs
    are shared with others, whose threads the scheduler places (docs/cpu_fast_path.md#threads).
    Tensor-parallel ranks are placed by tp_cpu_binding instead."""
    if mode == "nobind" or threads < 2:
        return []
    cpus = usable_cpu_ids()
    return cpus if len(cpus) == threads else []


# libgomp's idle threads spin up to GOMP_SPINCOUNT iterations (default 300,000) before they
# sleep; on cores shared with another busy process that spinning collapses decoding
# (docs/cpu_fast_path.md#threads). 300 avoids the collapse but slows a quiet machine's single
# stream, so it is advice, not a default (measurements: docs/design_measurements.md#openmp-spin-count).
LOW_SPINCOUNT = 300
OMP_WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def warn_if_busy(threads: int) -> None:
    """A warning when the 1-minute load average (other processes: the engine has not started yet) plus
    this engine's threads exceeds the usable CPUs by half a CPU or more, with the two remedies measured."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return
    cpus = available_cpus()
    if load + threads <= cpus + 0.5:
        return
    fewer = max(1, cpus - round(load))
    spin = ""
    if not any(os.environ.get(k) for k in OMP_WAIT_ENV):
        spin = (f"; or start the process with GOMP_SPINCOUNT={LOW_SPINCOUNT} (OpenMP threads then sleep"
                " instead of spinning while they wait: decoding slows in proportion to its CPU share)")  # fmt: skip
    logger.warning(
        "load average %.1f on %d usable CPUs: other processes share the cores with the %d compute threads. "
        "If decoding is slow, --threads %d (or OMP_NUM_THREADS) leaves them their cores%s",
        load, cpus, threads, fewer, spin,
    )  # fmt: skip
