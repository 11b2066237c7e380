"""A competitor's benchmark script run in the competitor's own environment, one timed round at a
time, so that a benchmark alternates its own rounds with the competitor's in one run (the script's
side: vllm_rounds.py). The script's logs go to a file; its stdout carries one JSON line per answer."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import TracebackType
from typing import IO, Any


class CompetitorError(RuntimeError):
    """The competitor's script failed to start or to answer; the message says how and names its log."""


def vllm_env(threads: int, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment vLLM's CPU build runs with beside tachyllm: its OpenMP threads bound to the
    first `threads` cores (run_all.sh's setting) and a KV cache of kv_cache_gib GiB (1 GiB holds
    ~46,000 tokens of the default model, more than the benchmarks' batches need)."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "OMP_NUM_THREADS": str(threads),
    }


class RoundProcess:
    """`command` started with its stderr in `log`; `ready` is the message it sent when set up."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.command, self.log_path = command, log
        self._log: IO[str] = open(log, "w")  # noqa: SIM115 - closed in close()
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        try:
            self.ready: dict[str, Any] = self._receive("start")["ready"]
        except BaseException:
            self.close()
            raise

    def round(self) -> dict[str, Any]:
        """One timed round's results."""
        assert self._process.stdin is not None
        self._process.stdin.write("round\n")
        self._process.stdin.flush()
        return self._receive("a round")

    def _receive(self, what: str) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            raise CompetitorError(f"{self._name()} exited with code {code} during {what}; {self._log_tail()}")
        try:
            message = json.loads(line)
        except ValueError:
            raise CompetitorError(f"{self._name()} printed {line.strip()!r} where an answer was expected") from None
        if "error" in message:
            raise CompetitorError(f"{self._name()} failed during {what}: {message['error']}; {self._log_tail()}")
        return message

    def _name(self) -> str:
        return Path(self.command[1]).name if len(self.command) > 1 else self.command[0]

    def _log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"the end of its log ({self.log_path}):\n" + "\n".join(tail)

    def close(self) -> None:
        """Ends the script (stdin closed: it returns after its round), killing it after a minute."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._log.close()

    def __enter__(self) -> RoundProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
