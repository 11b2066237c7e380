"""The checks every HTTP request passes before any route sees it (an ASGI middleware):

- the request's host is unambiguous and well formed: one Host header, `name[:port]` or
  `[v6 address][:port]` with nothing else in it (no user info, no spaces), and a request line in
  absolute form (`GET http://host/path`) naming the same host (a proxy or a cache in front that
  reads the other copy would otherwise disagree with this server about where the request went);
- that host is one this server answers to (DNS rebinding: a web page whose name resolves to
  127.0.0.1 would otherwise read the answers of a local server);
- a body (POST) is declared `application/json`, by one Content-Type header (CSRF: a page may send
  text/plain or form bodies to any address without the browser asking first, but not JSON);
- a body is at most `max_body_bytes`: a larger declared Content-Length is refused unread, and a
  body without one is cut off once it passes the limit;
- a body arrives within `body_timeout` seconds of the request's headers (a client trickling it
  would hold its connection for as long as it liked).

Refusals are OpenAI-format errors (400, 408, 421, 415, 413, and 503 for a connection beyond
--max-connections, which http_protocol.py marks), as the routes' own are.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tachyllm.server.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
BODY_METHODS = {"POST", "PUT", "PATCH"}
# Headers whose repetition would leave the request ambiguous (the last one would win).
SINGLE_HEADERS = ("host", "content-type")
# A Host value: a DNS name or IPv4 address, or a bracketed IPv6 address; an optional port.
HOST_SYNTAX = re.compile(r"(?:[a-z0-9_-]+(?:\.[a-z0-9_-]+)*\.?|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?", re.IGNORECASE)
# Set in the ASGI scope's "extensions" by http_protocol.py: the host a request line in absolute form
# names, and why the connection is refused (over --max-connections).
REQUEST_LINE_HOST = "tachyllm.request_line_host"
CONNECTION_REFUSED = "tachyllm.connection_refused"


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bound_host: str) -> list[str] | None:
    """Loopback names (and the bound address) for a server bound to loopback; None (any host) for
    one bound elsewhere, which clients reach by names this server cannot know."""
    if not is_loopback(bound_host):
        return None
    return sorted({*LOOPBACK_NAMES, host_name(bound_host)})


def request_line_host(target: str) -> str | None:
    """The authority of a request target in absolute form ('http://host:8000/path' -> 'host:8000');
    None for the usual path (origin form) and '*'."""
    if target.startswith("/") or target == "*" or "://" not in target:
        return None
    rest = target.split("://", 1)[1]
    return re.split(r"[/?#]", rest, maxsplit=1)[0]


def is_valid_host(value: str) -> bool:
    if not HOST_SYNTAX.fullmatch(value):
        return False
    port = value.rsplit("]", 1)[-1].partition(":")[2]
    return not port or int(port) <= 65535


def host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, allowed_hosts: list[str] | None, body_timeout: float = 0.0
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout  # seconds; 0 = none
        # Entries are read as Host headers are: a port, brackets and case do not matter.
        any_host = allowed_hosts is None or "*" in allowed_hosts
        self.allowed_hosts = None if allowed_hosts is None or any_host else set(map(host_name, allowed_hosts))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extensions = scope.get("extensions") or {}
        try:
            if refusal := extensions.get(CONNECTION_REFUSED):
                raise APIError(
                    503,
                    refusal,
                    "service_unavailable_error",
                    code="too_many_connections",
                    headers={"Connection": "close"},
                )
            headers = single_headers(scope["headers"])
            self.check(scope["method"], headers, extensions.get(REQUEST_LINE_HOST))
        except APIError as e:
            await send_error(send, e)
            return
        if scope["method"] in BODY_METHODS:
            receive = self.limited(receive)
        await self.app(scope, receive, send)

    def check(self, method: str, headers: dict[str, str], line_host: str | None = None) -> None:
        """`line_host`: the host the request line names (absolute form), which HTTP/1.1 makes the
        request's host."""
        host = headers.get("host")
        for value in (host, line_host):
            if value is not None and not is_valid_host(value):
                raise header_error(f"{value!r} is not a valid host (name or address, and an optional port)")
        if line_host is not None:
            if host is not None and host_name(host) != host_name(line_host):
                raise header_error(f"the request line names the host {line_host!r}, the Host header {host!r}")
            host = line_host
        # Browsers always send Host; a client without one is no page being rebound.
        if self.allowed_hosts is not None and host is not None and host_name(host) not in self.allowed_hosts:
            raise APIError(
                421,
                f"this server does not answer to the host {host!r}; start it with --allowed-hosts to add names",
                code="host_not_allowed",
            )
        if method not in BODY_METHODS:
            return
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            got = f"got {headers['content-type']!r}" if "content-type" in headers else "none was given"
            raise APIError(
                415, f"the request body must be JSON, sent with Content-Type: application/json ({got})",
                code="unsupported_media_type",
            )  # fmt: skip
        length = headers.get("content-length", "")
        if re.fullmatch(r"[0-9]+", length) and (len(length) > 18 or int(length) > self.max_body_bytes):
            raise self.too_large()

    def limited(self, receive: Receive) -> Receive:
        """`receive` refusing a body over the size limit, or one still incomplete at the deadline; the
        route reading the body answers the refusal, as any APIError. Once the body is in, `receive`
        is left alone: a streaming response waits on it for the client's disconnect."""
        received = 0
        body_complete = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout

        async def receive_within_limit() -> Message:
            nonlocal received, body_complete
            if body_complete or self.body_timeout <= 0:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
                except TimeoutError:
                    raise APIError(
                        408,
                        f"the request body did not arrive within {self.body_timeout:g} s of its headers "
                        "(--body-read-timeout)",
                        code="request_timeout",
                        headers={"Connection": "close"},
                    ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_complete = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    raise self.too_large()
            return message

        return receive_within_limit

    def too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
            "(--max-request-body-bytes)",
            code="request_too_large",
        )


def single_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers by name (the last of a repeated one), refusing a repeated Host or Content-Type."""
    headers: dict[str, str] = {}
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name in headers and name in SINGLE_HEADERS:
            raise header_error(f"the request has more than one {name.title()} header; send one")
        headers[name] = value.decode("latin-1")
    return headers


def header_error(message: str) -> APIError:
    # The connection is closed after the answer: a client this confused may have framed more badly.
    return APIError(400, message, code="invalid_headers", headers={"Connection": "close"})


async def send_error(send: Send, error: APIError) -> None:
    body = error.body.model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    if error.status in (413, 421):  # the unread body (413) or a confused client (421): do not reuse
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
