"""Request tracing in the server (docs/observability.md): an ASGI middleware gives each generation or pooling
request an `llm_request` span, continuing the caller's W3C trace context (traceparent / tracestate) and naming the
trace in the response's headers; admission hands it the request's engine streams, whose outputs carry
the engine's timings and events; the span is built when the response has been sent."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from tachyllm.otel import RequestTracer, TracedRequest
from tachyllm.outputs import EngineOutput
from tachyllm.server.async_engine import OutputStream
from tachyllm.server.state import MetricsSource

# The GenAI operation name (OpenTelemetry semantic conventions) of each traced route. The conventions name
# no operation for scoring pairs: score and rerank are the names of vLLM's routes and pooling tasks.
TRACED_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/embeddings": "embeddings",
    "/v1/score": "score",
    **dict.fromkeys(("/v1/rerank", "/v2/rerank", "/rerank"), "rerank"),
}
_TRACE_HEADERS = (b"traceparent", b"tracestate")

# The traced request being served in this task (set by RequestTracing, read by admission and the routes).
_current: ContextVar[TracedRequest | None] = ContextVar("tachy_traced_request", default=None)


def current_request() -> TracedRequest | None:
    """The request being traced, or None when tracing is off (or the route is not traced)."""
    return _current.get()


@contextmanager
def tracing(request: TracedRequest) -> Iterator[TracedRequest]:
    """Makes `request` the one being traced in this task (and the tasks it starts)."""
    token = _current.set(request)
    try:
        yield request
    finally:
        _current.reset(token)


class TracedStream:
    """An engine stream whose outputs are also kept for the request's trace."""

    def __init__(self, stream: OutputStream, request: TracedRequest) -> None:
        self._stream = stream
        self._request = request
        self.request_id = stream.request_id

    def __aiter__(self) -> TracedStream:
        return self

    async def __anext__(self) -> EngineOutput:
        out = await self._stream.__anext__()
        self._request.observe(out)
        return out

    def close(self) -> None:
        self._stream.close()


class RequestTracing:
    """ASGI middleware: one span per POST to a generation or pooling route, ended once its response is sent."""

    def __init__(self, app, tracer: RequestTracer) -> None:
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope, receive, send) -> None:
        operation = None
        if scope["type"] == "http" and scope["method"] == "POST":
            operation = TRACED_ROUTES.get(scope["path"].removeprefix(scope.get("root_path", "")))
        if operation is None:
            await self.app(scope, receive, send)
            return
        start = time.time()
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _TRACE_HEADERS}
        span = self.tracer.start(carrier, start)
        request = TracedRequest(start, operation, record_text=self.tracer.options.record_text)
        headers = [(k.encode(), v.encode()) for k, v in self.tracer.context_headers(span).items()]
        error_body: list[bytes] = []

        async def send_traced(message) -> None:
            if message["type"] == "http.response.start":
                request.status_code = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            elif message["type"] == "http.response.body" and (request.status_code or 0) >= 400:
                error_body.append(message.get("body", b""))
            await send(message)

        try:
            with tracing(request):
                await self.app(scope, receive, send_traced)
        except BaseException as e:
            request.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            # 499: the client hung up, an abort rather than a failure (the finish reason says so).
            if request.error is None and (request.status_code or 0) >= 400 and request.status_code != 499:
                request.error = _error_message(b"".join(error_body), request.status_code or 0)
            self.tracer.finish(span, request)


def _error_message(body: bytes, status: int) -> str:
    """An error response's message (the OpenAI error format), else its status."""
    try:
        return f"{status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


def dropped_spans_metrics(tracer: RequestTracer, prefix: str) -> MetricsSource:
    """/metrics' count of spans that never reached the collector."""

    class Collector:
        def collect(self):
            family = CounterMetricFamily(
                f"{prefix}:trace_spans_dropped", "Request trace spans dropped: export queue full or export failed."
            )
            family.add_metric([], tracer.dropped_spans)
            yield family

    registry = CollectorRegistry()
    registry.register(Collector())

    async def source() -> list[tuple[dict[str, str], bytes]]:
        return [({}, generate_latest(registry))]

    return source
