"""The HTTP layer under the routes, spoken in raw bytes (an HTTP client would normalize what these
tests send): ambiguous or malformed hosts and repeated headers are refused, slow clients are
disconnected after the read timeouts while others are served, and connections beyond
--max-connections are refused."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers.server import graceful_server

from tachyllm.entrypoints.serve import GracefulServer

# Short deadlines, so that a slow client is cut off within a test's time; a cap the tests reach.
TIMEOUT_S = 1.0
MAX_CONNECTIONS = 4
FLAGS = ["--header-read-timeout", str(TIMEOUT_S), "--body-read-timeout", str(TIMEOUT_S)]
FLAGS += ["--max-connections", str(MAX_CONNECTIONS)]


@pytest.fixture(scope="module")
def served(tiny_model_factory) -> Iterator[tuple[str, GracefulServer]]:
    with graceful_server(str(tiny_model_factory("llama")), *FLAGS) as (url, server):
        yield url, server


@pytest.fixture
def base(served) -> str:
    return served[0]


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def exchange(base: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends `request` as it is on a new connection; the answer's status, headers and body, read until
    the server closes the connection."""
    with connect(base) as sock:
        sock.sendall(request)
        return parse_response(read_until_closed(sock))


def parse_response(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def refused(base: str, request: bytes, status: int) -> dict:
    got, headers, body = exchange(base, request)
    assert got == status, body
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    return json.loads(body)["error"]


GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
TOKENIZE = b'{"prompt": "hi"}'


@pytest.mark.parametrize(
    "request_bytes, says",
    [
        (
            b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(TOKENIZE), TOKENIZE),
            "more than one Content-Type header",
        ),
        (b"GET /v1/models HTTP/1.1\r\nHost: attacker.example\r\nHost: localhost\r\n\r\n", "more than one Host header"),
        (b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nhost: localhost\r\n\r\n", "more than one Host header"),
        (GET_MODELS % b"localhost:80@attacker.example", "'localhost:80@attacker.example' is not a valid host"),
        (GET_MODELS % b"user@localhost", "'user@localhost' is not a valid host"),
        (GET_MODELS % b"localhost:http", "'localhost:http' is not a valid host"),
        (GET_MODELS % b"localhost:99999", "'localhost:99999' is not a valid host"),
        (GET_MODELS % b"local host", "'local host' is not a valid host"),
        (GET_MODELS % b"localhost/x", "'localhost/x' is not a valid host"),
        (GET_MODELS % b"[::1", "'[::1' is not a valid host"),
        (
            b"GET http://attacker.example/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n",
            "the request line names the host 'attacker.example', the Host header 'localhost'",
        ),
        (
            b"GET http://localhost@attacker.example/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n",
            "'localhost@attacker.example' is not a valid host",
        ),
    ],
    ids=[
        "content-type twice",
        "host twice",
        "host twice, same value",
        "user info after port",
        "user info",
        "port not a number",
        "port too large",
        "space",
        "path",
        "bracket unclosed",
        "request line host",
        "request line user info",
    ],  # fmt: skip
)
def test_ambiguous_or_malformed_request_heads_are_400(base, request_bytes, says):
    error = refused(base, request_bytes, 400)
    assert error["code"] == "invalid_headers" and says in error["message"], error


def test_the_request_line_host_is_checked_as_the_host_header_is(base):
    # Both name the same foreign host: not ambiguous, but not a host a loopback server answers to.
    request = b"GET http://attacker.example/v1/models HTTP/1.1\r\nHost: attacker.example\r\n\r\n"
    assert refused(base, request, 421)["code"] == "host_not_allowed"
    request = b"GET http://attacker.example/v1/models HTTP/1.1\r\n\r\n"  # HTTP/1.1 without Host
    assert refused(base, request, 421)["code"] == "host_not_allowed"
    # The request line may name this server, with or without a port, as HTTP/1.1 allows.
    for request in (
        b"GET http://localhost/v1/models HTTP/1.1\r\nHost: localhost:8000\r\nConnection: close\r\n\r\n",
        b"GET http://127.0.0.1:8000/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    ):
        status, _, body = exchange(base, request)
        assert status == 200 and json.loads(body)["object"] == "list"
    for host in (b"localhost", b"localhost:8000", b"127.0.0.1:1", b"[::1]:8000", b"LOCALHOST"):
        status, _, body = exchange(base, GET_MODELS % host)
        assert status == 200, (host, body)


def trickle(sock: socket.socket, data: bytes, interval_s: float) -> tuple[bytes, float]:
    """Sends `data` a byte every `interval_s` while reading what the server answers; stops once the
    server has closed the connection. Returns the answer and when the connection was closed (seconds
    after the start), or the whole data was sent."""
    started = time.monotonic()
    sock.settimeout(interval_s)
    answer = b""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:  # closed by the server
            break
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        answer += chunk
    return answer, time.monotonic() - started


def served_meanwhile(base: str, stop: threading.Event) -> list[int]:
    """Statuses of the ordinary requests a client sent until `stop`."""
    statuses = []
    with httpx.Client(base_url=base, timeout=30) as c:
        while not stop.is_set() or not statuses:
            statuses.append(c.post("/tokenize", json={"prompt": "hi"}).status_code)
            time.sleep(0.05)
    return statuses


def cut_off_while_others_are_served(base: str, data: bytes, head: bytes = b"") -> tuple[bytes, float, list[int]]:
    stop, statuses = threading.Event(), []
    other = threading.Thread(target=lambda: statuses.extend(served_meanwhile(base, stop)))
    other.start()
    try:
        with connect(base) as sock:
            sock.sendall(head)
            answer, closed_after = trickle(sock, data, interval_s=0.1)
    finally:
        stop.set()
        other.join(30)
    return answer, closed_after, statuses


def test_a_client_sending_its_headers_slowly_is_disconnected(base):
    # Headers at 10 bytes a second would take ~12 s: the client is cut off after the 1 s timeout
    # (with a 408), while another client's requests go on being answered.
    headers = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nUser-Agent: slow-client/1.0 trickle\r\n\r\n"
    answer, closed_after, statuses = cut_off_while_others_are_served(base, headers)
    assert TIMEOUT_S / 2 <= closed_after < TIMEOUT_S + 5, closed_after  # cut off by the timeout, not at once
    status, _, body = parse_response(answer)
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert "--header-read-timeout" in json.loads(body)["error"]["message"]
    assert statuses and set(statuses) == {200}, statuses


def test_a_client_sending_its_body_slowly_is_disconnected(base):
    body = json.dumps({"prompt": "The quick brown fox " * 6}).encode()
    head = b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    answer, closed_after, statuses = cut_off_while_others_are_served(base, body, head)
    assert TIMEOUT_S / 2 <= closed_after < TIMEOUT_S + 5, closed_after  # cut off by the timeout, not at once
    status, headers, error = parse_response(answer)
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(error)["error"]["code"] == "request_timeout"
    assert "--body-read-timeout" in json.loads(error)["error"]["message"]
    assert statuses and set(statuses) == {200}, statuses


def test_connections_beyond_the_cap_are_refused_and_the_others_served(served):
    base, server = served
    deadline = time.monotonic() + 10  # the connections of earlier tests are gone
    while server.server_state.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    held = [connect(base) for _ in range(MAX_CONNECTIONS)]
    try:
        # Each held connection is open on the server once it answers a request on it.
        for sock in held:
            sock.sendall(b"GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        error = refused(base, GET_MODELS % b"localhost", 503)
        assert error["code"] == "too_many_connections" and "--max-connections" in error["message"]
        held[0].sendall(b"GET /version HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert parse_response(read_until_closed(held[0]))[0] == 200  # an open connection is still served
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10  # the server sees the closed connections go
    while (status := exchange(base, GET_MODELS % b"localhost")[0]) == 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 200
