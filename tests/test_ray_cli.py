"""`tachy serve --replicas N` as a user runs it: the command starts its own local Ray instance, serves the
OpenAI API through Ray Serve's proxy, listens only on its --host, and stops Ray on SIGINT with exit
status 0. The tests share one server and run in file order (the last one stops it)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from helpers.server import free_port

from tachyllm.ray_serve.listeners import RAY_MULTI_HOST_SWITCH, local_ray_options

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.ray]

API_KEY = "k"


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    """The running `tachy serve --replicas 2 --host 127.0.0.1` process and its base URL."""
    port = free_port()
    command = [
        sys.executable, "-m", "tachyllm.entrypoints.cli", "serve", "--model", f"tiny={tiny_model_factory('llama')}",
        "--replicas", "2", "--threads-per-replica", "1", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--kv-cache-memory", "4M", "--api-key", API_KEY,
    ]  # fmt: skip
    # Whatever addresses the machine's environment forces on Ray, the command must choose its own; and
    # without --ray-address it starts an instance of its own, whatever RAY_ADDRESS names (nothing here).
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    env["RAY_ADDRESS"] = "127.0.0.1:9"
    log_path = tmp_path_factory.mktemp("ray-cli") / "serve.log"
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "tachy serve --replicas did not come up"
            try:
                if httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield process, base
    finally:
        if process.poll() is None:  # a test failed before the last one stopped it: stop Ray's processes too
            tree = psutil.Process(process.pid).children(recursive=True)
            process.kill()
            process.wait()
            for child in tree:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
        log.close()


def listening_addresses(pid: int) -> dict[str, list[str]]:
    """Listening TCP/UDP address -> the processes of `pid`'s tree that hold it."""
    found: dict[str, list[str]] = {}
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and not conn.raddr):
                    found.setdefault(f"{conn.laddr.ip} port {conn.laddr.port}", []).append(name)
        except psutil.NoSuchProcess:  # a worker that ended meanwhile
            pass
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split(" port ")[0])
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def test_every_listener_of_the_process_tree_is_on_loopback(server):
    """Ray's internal services run code for whoever reaches them: with --host 127.0.0.1 none of the
    GCS, raylet, object manager, agents, metrics exporters, Serve's proxy and replicas (their gRPC
    servers) may listen on a wildcard or outward address."""
    process, base = server
    httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
               headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)  # fmt: skip
    addresses = listening_addresses(process.pid)
    assert len(addresses) > 5, addresses  # Ray's services are in the tree
    exposed = {address: names for address, names in addresses.items() if not is_loopback(address)}
    assert not exposed, exposed


def test_tachy_serve_replicas_serves_and_stops(server):
    process, base = server
    with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
        body = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}).json()
        assert body["usage"]["completion_tokens"] == 3
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 0


@pytest.mark.parametrize(
    ("host", "options", "loopback_only"),
    [
        ("127.0.0.1", {"_node_ip_address": "127.0.0.1"}, True),
        ("[::1]", {"_node_ip_address": "::1"}, True),
        ("localhost", {"_node_ip_address": "localhost"}, True),
        ("10.1.2.3", {"_node_ip_address": "10.1.2.3"}, False),
        ("0.0.0.0", {}, False),
        ("::", {}, False),
        ("inference.internal", {}, False),  # a name: Ray finds the node's address itself
    ],
)
def test_the_ray_node_is_put_on_the_host_asked_for(host, options, loopback_only, monkeypatch):
    monkeypatch.delenv(RAY_MULTI_HOST_SWITCH, raising=False)
    assert local_ray_options(host) == options
    assert (os.environ.get(RAY_MULTI_HOST_SWITCH) == "0") == loopback_only
