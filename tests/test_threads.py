"""default_threads: the affinity mask and a cgroup CPU quota, not os.cpu_count(), set the thread count;
compute_thread_cpus and the engine pin the OpenMP workers (--omp-threads-bind), not the calling thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tachyllm import platform
from tachyllm.kernels import native


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An 8-CPU machine with no limits; tests write cgroup files under the returned root."""
    root = tmp_path / "cgroup"
    root.mkdir()
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("0::/\n")
    monkeypatch.setattr(platform, "CGROUP_ROOT", root)
    monkeypatch.setattr(platform, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(platform.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return root, proc


def test_all_cpus_without_limits(machine):
    assert platform.cgroup_cpu_quota() is None
    assert platform.default_threads() == 8


def test_affinity_mask(machine, monkeypatch):
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda pid: {2, 5, 6}, raising=False)  # taskset -c 2,5,6
    assert platform.default_threads() == 3


def test_no_affinity_call_falls_back_to_cpu_count(machine, monkeypatch):
    monkeypatch.delattr(platform.os, "sched_getaffinity", raising=False)  # macOS, Windows
    assert platform.default_threads() == 8


QUOTAS = [("max 100000", 8), ("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1), ("100000 100000", 1),
          ("1600000 100000", 8)]  # fmt: skip


@pytest.mark.parametrize(("cpu_max", "threads"), QUOTAS)
def test_cgroup_v2_quota(machine, cpu_max, threads):
    root, _ = machine
    (root / "cpu.max").write_text(cpu_max + "\n")
    assert platform.default_threads() == threads


def test_cgroup_v2_nested_parent_limit(machine):
    """A Kubernetes pod: the limit sits on the pod's cgroup, the process in a child (the container)."""
    root, proc = machine
    child = root / "kubepods" / "pod1" / "ctr"
    child.mkdir(parents=True)
    (child / "cpu.max").write_text("max 100000\n")
    (root / "kubepods" / "pod1" / "cpu.max").write_text("300000 100000\n")
    proc.write_text("0::/kubepods/pod1/ctr\n")
    assert platform.cgroup_cpu_quota() == pytest.approx(3.0)
    assert platform.default_threads() == 3


def test_cgroup_v1_quota(machine):
    root, proc = machine
    cpu = root / "cpu,cpuacct" / "docker" / "abc"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("250000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")  # the hierarchy's root: unlimited
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n")
    assert platform.cgroup_cpu_quota() == pytest.approx(2.5)
    assert platform.default_threads() == 3


def test_quota_and_affinity_take_the_smaller(machine, monkeypatch):
    root, _ = machine
    (root / "cpu.max").write_text("400000 100000\n")
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert platform.default_threads() == 2


def test_unreadable_or_malformed_files_are_no_limit(machine):
    root, proc = machine
    (root / "cpu.max").write_text("garbage\n")
    (root / "cpu.cfs_quota_us").write_text("x\n")
    (root / "cpu.cfs_period_us").write_text("100000\n")
    proc.unlink()
    assert platform.cgroup_cpu_quota() is None
    assert platform.default_threads() == 8


def test_omp_num_threads_wins(machine, monkeypatch):
    root, _ = machine
    (root / "cpu.max").write_text("100000 100000\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert platform.default_threads() == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    assert platform.default_threads() == 1


def test_busy_machine_warns(machine, monkeypatch, caplog):
    monkeypatch.setattr(platform.os, "getloadavg", lambda: (3.0, 3.0, 2.0))  # 3 CPUs busy elsewhere, 8 threads
    for name in platform.OMP_WAIT_ENV:
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level("WARNING", logger="tachyllm"):
        assert platform.default_threads() == 8
    assert "load average 3.0 on 8 usable CPUs" in caplog.text and "--threads 5" in caplog.text
    assert f"GOMP_SPINCOUNT={platform.LOW_SPINCOUNT}" in caplog.text
    caplog.clear()
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the user chose a policy: only the thread advice
    with caplog.at_level("WARNING", logger="tachyllm"):
        platform.default_threads()
    assert "--threads 5" in caplog.text and "GOMP_SPINCOUNT" not in caplog.text


def test_quiet_machine_does_not_warn(machine, monkeypatch, caplog):
    monkeypatch.setattr(platform.os, "getloadavg", lambda: (0.4, 0.5, 0.5))
    with caplog.at_level("WARNING", logger="tachyllm"):
        platform.default_threads()
    assert caplog.text == ""


def test_auto_pins_only_when_a_thread_runs_on_every_usable_cpu(machine, monkeypatch):
    assert platform.compute_thread_cpus("auto", 8) == list(range(8))
    assert platform.compute_thread_cpus("auto", 4) == []  # the other CPUs are shared: the scheduler places threads
    assert platform.compute_thread_cpus("auto", 1) == []
    assert platform.compute_thread_cpus("nobind", 8) == []
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda pid: {6, 2, 5}, raising=False)
    assert platform.compute_thread_cpus("auto", 3) == [2, 5, 6]
    monkeypatch.delattr(platform.os, "sched_getaffinity", raising=False)
    assert platform.compute_thread_cpus("auto", 8) == []


# An engine on two CPUs of this machine, in a process of its own (a pinned OpenMP worker stays pinned for
# the process's life): each thread's CPU list, the engine's answer, and which CPUs the engine pinned.
PINNING_CHILD = """
import glob, json, logging, os, sys
logging.basicConfig(level=logging.INFO)
os.sched_setaffinity(0, {first, second})
from tachyllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", threads=2, kv_cache_memory=4 << 20, omp_threads_bind=sys.argv[2])
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
tasks = {int(f.split("/")[4]): open(f).read().split("Cpus_allowed_list:")[1].split()[0]
         for f in glob.glob("/proc/self/task/*/status")}
tokens = out[0].outputs[0].token_ids
print(json.dumps({"main": tasks.pop(os.getpid()), "others": sorted(tasks.values()), "tokens": tokens}))
"""


@pytest.mark.parametrize("mode", ["auto", "nobind"])
def test_engine_pins_its_worker_threads_not_the_caller(tiny_model_factory, mode):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or native.native_ops() is None:
        pytest.skip("needs two CPUs and the C++ kernels")
    first, second = cpus[:2]
    script = PINNING_CHILD.replace("{first, second}", f"{{{first}, {second}}}")
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model_factory()), mode], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(seen["tokens"]) == 4
    both = f"{first}-{second}" if second == first + 1 else f"{first},{second}"
    assert seen["main"] == both  # the calling thread keeps its CPUs
    pinned = [c for c in seen["others"] if c == str(second)]
    assert len(pinned) == (1 if mode == "auto" else 0), seen
    assert (f"compute threads pinned to CPUs [{second}]" in done.stderr) == (mode == "auto")
