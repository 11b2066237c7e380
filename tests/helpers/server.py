"""Servers for the tests: a uvicorn server in a thread or `tachy serve` in its own process on a free port,
and readers of their answers (OpenAI-format errors, server-sent events, /metrics)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser
from tachyllm.entrypoints.serve import GracefulServer, make_server
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine


@contextmanager
def serving(server) -> Iterator[str]:
    """Runs a uvicorn server in a thread (port 0 = a free one); yields its base URL."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)


ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4M", "--log-stats-interval", "0"]


@contextmanager
def running_server(model: str, *flags: str) -> Iterator[str]:
    """A real uvicorn server in a thread, on a free port; yields its base URL."""
    with graceful_server(model, *flags) as (base, _):
        yield base


@contextmanager
def graceful_server(model: str, *flags: str) -> Iterator[tuple[str, GracefulServer]]:
    """running_server's server itself too (its state, its exit code)."""
    with thread_server(["--model", model, *ENGINE_FLAGS, *flags]) as (base, server, _):
        yield base, server


@contextmanager
def thread_server(serve_args: list[str]) -> Iterator[tuple[str, GracefulServer, AsyncEngine]]:
    """`tachy serve SERVE_ARGS` as a uvicorn server in a thread, on a free port (the benchmarks' servers
    too); yields its base URL, the server and its engine, which stops with the server."""
    args = build_parser().parse_args(["serve", "--port", "0", *serve_args])
    engine = AsyncEngine(lambda: LLMEngine(engine_config(args)))
    server = make_server(build_app(engine, args), args)
    with serving(server) as base:
        yield base, server, engine


def metrics(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels without model_name)."""
    response = http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def wait_idle(http: httpx.Client, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        idle = (
            m[("tachy:kv_cache_usage_perc", ())] == 0
            and m[("tachy:num_requests_running", ())] == 0
            and m[("tachy:num_requests_waiting", ())] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(model: str, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`tachy serve` in its own process (stderr piped), once /health answers 200; killed if still up at the end."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tachyllm.entrypoints.cli", "serve", "--model", model, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tool_room_url(tiny_model_factory) -> Iterator[str]:
    """A module's `tachy serve` of the tiny llama as model "m", with 2048 positions: the tiny tokenizer
    spells a tool list in many tokens. Test modules take it as their `url` fixture
    (`from helpers.server import tool_room_url as url`)."""
    with running_server(
        str(tiny_model_factory("llama", max_position_embeddings=2048)), "--served-model-name", "m"
    ) as base:
        yield base
