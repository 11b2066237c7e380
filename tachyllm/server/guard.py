"""The checks every HTTP request passes before any route sees it (an ASGI middleware):

- the Host header is one this server answers to (DNS rebinding: a web page whose name resolves to
  127.0.0.1 would otherwise read the answers of a local server);
- a body (POST) is declared `application/json` (CSRF: a page may send text/plain or form bodies
  to any address without the browser asking first, but not JSON);
- a body is at most `max_body_bytes`: a larger declared Content-Length is refused unread, and a
  body without one is cut off once it passes the limit.

Refusals are OpenAI-format errors (421, 415, 413), as the routes' own are.
"""

from __future__ import annotations

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


def host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, allowed_hosts: list[str] | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # Entries are read as Host headers are: a port, brackets and case do not matter.
        any_host = allowed_hosts is None or "*" in allowed_hosts
        self.allowed_hosts = None if any_host else set(map(host_name, allowed_hosts))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self.check(scope["method"], headers)
        except APIError as e:
            await send_error(send, e)
            return
        if scope["method"] in BODY_METHODS:
            receive = self.limited(receive)
        await self.app(scope, receive, send)

    def check(self, method: str, headers: dict[str, str]) -> None:
        host = headers.get("host")
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
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self.too_large()  # the route reading the body answers it, as any APIError
            return message

        return receive_within_limit

    def too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
            "(--max-request-body-bytes)",
            code="request_too_large",
        )


async def send_error(send: Send, error: APIError) -> None:
    body = error.body.model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    if error.status in (413, 421):  # the unread body (413) or a confused client (421): do not reuse
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
