"""`tachy serve --replicas N` as a user runs it: the command starts its own local Ray instance, serves the
OpenAI API through Ray Serve's proxy, and stops Ray on SIGINT with exit status 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray")

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tachy_serve_replicas_starts_ray_serves_and_stops(tiny_model_factory, tmp_path):
    port = free_port()
    command = [
        sys.executable, "-m", "tachyllm.entrypoints.cli", "serve", "--model", f"tiny={tiny_model_factory('llama')}",
        "--replicas", "2", "--threads-per-replica", "1", "--port", str(port), "--dtype", "float32",
        "--kv-cache-memory", "4M", "--api-key", "k",
    ]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers={"Authorization": "Bearer k"}) as c:
            deadline = time.monotonic() + 180
            while True:
                assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "tachy serve --replicas did not come up"
                try:
                    if c.get("/v1/models").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
            body = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}).json()
            assert body["usage"]["completion_tokens"] == 3
            assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
