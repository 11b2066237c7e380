"""The HTTP/1.1 connection handling of `tachy serve`: uvicorn's httptools protocol with what uvicorn
does not bound itself.

- **Header read timeout.** uvicorn waits for a request's headers as long as the client keeps the
  connection open: a client sending them a byte a second holds a connection (and a file descriptor)
  for as long as it likes, and enough of them exhaust the process. A request's headers must now be
  in within `header_timeout` seconds of its first byte (of the connection's opening, for its first
  request); otherwise the connection gets a 408 and is closed. The body's own deadline is the
  RequestGuard's (guard.py), which sees the body arrive.
- **Connection cap.** Beyond `max_connections` open connections, a new connection's request gets a
  503 and the connection is closed; the connections already open are served as before. (uvicorn's
  own `limit_concurrency` refuses every request of every connection once the count is reached.)
- **The request line's host.** A request line in absolute form (`GET http://host/path HTTP/1.1`)
  names the host the request is for; uvicorn keeps only its path. The protocol hands that host to
  the RequestGuard, which checks it as it checks the Host header.

The facts reach the guard in the ASGI scope's `extensions` (the keys are guard.py's).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from tachyllm.server.errors import APIError
from tachyllm.server.guard import CONNECTION_REFUSED, REQUEST_LINE_HOST, request_line_host


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float  # seconds (--header-read-timeout); 0 = none
    max_connections: int | None  # --max-connections; None = no cap


class GuardedHttpProtocol(HttpToolsProtocol):
    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.header_timer: asyncio.TimerHandle | None = None
        self.over_capacity = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections
        self.over_capacity = cap is not None and len(self.connections) > cap
        self.arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_timer is None:  # the first request's timer runs from the connection's opening
            self.arm_header_timer()

    def on_headers_complete(self) -> None:
        self.cancel_header_timer()
        # Keys of this server's own: ASGI types an extension's value as a dict, these carry a string.
        extensions = cast(dict[str, object], self.scope.setdefault("extensions", {}))
        if self.over_capacity:
            extensions[CONNECTION_REFUSED] = (
                f"this server holds its limit of {self.limits.max_connections} open connections "
                "(--max-connections); retry later"
            )
        if (host := request_line_host(self.url.decode("latin-1"))) is not None:
            extensions[REQUEST_LINE_HOST] = host
        super().on_headers_complete()

    def arm_header_timer(self) -> None:
        if self.limits.header_timeout > 0:
            self.header_timer = self.loop.call_later(self.limits.header_timeout, self.on_header_timeout)

    def cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def on_header_timeout(self) -> None:
        self.header_timer = None
        if self.transport.is_closing():
            return
        # A response still being written (a pipelined request's headers are what is late) is cut short.
        if self.cycle is None or self.cycle.response_complete:
            error = APIError(
                408,
                f"the request's headers did not arrive within {self.limits.header_timeout:g} s (--header-read-timeout)",
                code="request_timeout",
            )
            body = error.body.model_dump_json().encode()
            head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            self.transport.write(STATUS_LINE[408] + head + body)
        self.transport.close()
