"""A real OTLP trace receiver for tests: ExportTraceServiceRequest messages over HTTP (protobuf) and gRPC,
decoded as a collector would, with the path and headers each export came with."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start: float  # seconds
    end: float
    attributes: dict[str, Any]
    events: list[tuple[str, float, dict[str, Any]]]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    resource: dict[str, Any]


@dataclass
class Receiver:
    spans: list[Span] = field(default_factory=list)
    exports: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (path, headers) of each export
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, message: bytes, path: str, headers: dict[str, str]) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(message)
        with self.lock:
            self.exports.append((path, headers))
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            Span(
                                s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                s.start_time_unix_nano / 1e9, s.end_time_unix_nano / 1e9,
                                {a.key: _value(a.value) for a in s.attributes},
                                [(e.name, e.time_unix_nano / 1e9, {a.key: _value(a.value) for a in e.attributes})
                                 for e in s.events],
                                s.status.code, s.status.message, resource,
                            )
                        )  # fmt: skip

    def wait_for(self, name: str, count: int = 1, timeout: float = 30.0) -> list[Span]:
        """The spans called `name`, once at least `count` arrived (bounded polling)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = [s for s in self.spans if s.name == name]
            if len(found) >= count or time.monotonic() > deadline:
                assert len(found) >= count, f"{len(found)} {name!r} spans arrived, expected {count}"
                return found
            time.sleep(0.02)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@contextmanager
def http_receiver() -> Iterator[tuple[Receiver, str]]:
    """An OTLP/HTTP receiver on a free port: yields it and its base URL."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            receiver.add(body, self.path, {k.lower(): v for k, v in self.headers.items()})
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def grpc_receiver() -> Iterator[tuple[Receiver, str]]:
    """An OTLP/gRPC receiver on a free port: yields it and its endpoint URL."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    receiver = Receiver()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            headers = {k: v for k, v in context.invocation_metadata()}
            receiver.add(request.SerializeToString(), "grpc", headers)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)
