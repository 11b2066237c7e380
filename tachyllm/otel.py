"""Request tracing over OpenTelemetry (docs/observability.md): one `llm_request` span per API request,
or per prompt of an `LLM.generate` call (under one root span per call), built when it ends from what the
engine recorded (RequestMetrics: timestamps, events), and exported over OTLP by the SDK's batch
processor on its own thread.

Attribute names are vLLM's (gen_ai.latency.*, gen_ai.usage.prompt_tokens, ...) and, beside them, the
current OpenTelemetry GenAI semantic conventions' (gen_ai.usage.input_tokens, ...). Prompts and outputs
are recorded only when asked for (record_text). The opentelemetry packages are an optional extra,
imported only when tracing is on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from tachyllm.config import EngineConfig
from tachyllm.errors import ConfigError
from tachyllm.outputs import EngineOutput, RequestEvent, RequestMetrics, RequestOutput
from tachyllm.sampling_params import SamplingParams

logger = logging.getLogger("tachyllm")

TRACING_EXTRA = "pip install 'tachyllm[tracing]'"
SPAN_NAME = "llm_request"
# The response header that names the request's trace (hex trace id), and W3C's draft header that
# carries the server span's context back (Trace Context Level 2 `traceresponse`).
TRACE_ID_HEADER = "x-trace-id"
TRACE_RESPONSE_HEADER = "traceresponse"
# Spans waiting to be exported at most; more are dropped (and counted) rather than held in memory.
MAX_QUEUED_SPANS = 2048


@dataclass(frozen=True)
class TraceOptions:
    """Where request traces go and what they hold (EngineConfig's otlp_traces_endpoint / otlp_traces_record_text)."""

    endpoint: str
    record_text: bool = False


def trace_options(config: EngineConfig) -> TraceOptions | None:
    """Where an engine's requests are traced (its otlp_* options), or None when they are not."""
    if config.otlp_traces_endpoint is None:
        return None
    return TraceOptions(config.otlp_traces_endpoint, config.otlp_traces_record_text)


@dataclass
class EngineRequestTrace:
    """What the trace keeps of one engine request: its latest output (whose metrics are the request's own,
    growing in place) and, per sample, the tokens and text parts of its DELTA (or one FINAL_ONLY) outputs.
    A pooling request's one output has no samples: its prompt and timings are all there is."""

    last: EngineOutput
    num_tokens: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)  # record_text only

    @property
    def reasons(self) -> list[str]:
        return [self.finish_reasons[i] or "abort" for i in sorted(self.finish_reasons)]


@dataclass
class TracedRequest:
    """One API request (or one prompt of an LLM.generate call) as its span sees it: its engine requests'
    outputs and what happened before they reached the engine. Filled by whoever runs the request, read once
    at its end."""

    start_time: float  # time.time() when the request came in
    operation: str  # GenAI operation name: "chat", "text_completion"; pooling: "embeddings", "score", "rerank"
    model: str | None = None
    request_id: str | None = None
    params: list[SamplingParams] = field(default_factory=list)
    prompts: list[str | None] = field(default_factory=list)  # kept only with record_text
    admitted_time: float | None = None  # inputs templated, tokenized and checked; handed to the engine
    grammar_compile_seconds: float = 0.0
    engine_requests: dict[str, EngineRequestTrace] = field(default_factory=dict)  # by engine request id
    error: str | None = None  # why the request failed, when it did before or outside the engine
    status_code: int | None = None  # the HTTP status of the response
    record_text: bool = False  # keep the prompts and the generated text (TraceOptions.record_text)
    # What happened to it outside the engine (Ray Serve: each replica it was sent to, each retry).
    events: list[RequestEvent] = field(default_factory=list)

    def record(self, name: str, **attributes: Any) -> None:
        self.events.append(RequestEvent(name, time.time(), attributes))

    def observe(self, out: EngineOutput) -> None:
        """Takes an engine request's DELTA output (or its one FINAL_ONLY output, or a pooling request's one
        output): O(its new tokens)."""
        kept = self.engine_requests.get(out.request_id)
        if kept is None:
            kept = self.engine_requests[out.request_id] = EngineRequestTrace(out)
        kept.last = out
        if not isinstance(out, RequestOutput):
            return
        for c in out.outputs:
            kept.num_tokens[c.index] = kept.num_tokens.get(c.index, 0) + len(c.token_ids)
            kept.finish_reasons[c.index] = c.finish_reason
            if self.record_text:
                kept.texts.setdefault(c.index, []).append(c.text)


def _sdk():
    """The opentelemetry SDK modules, or a one-line error naming the extra."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as e:
        raise ConfigError(
            f"--otlp-traces-endpoint needs the OpenTelemetry packages ({e.name} is missing): {TRACING_EXTRA}"
        ) from None
    return (
        trace, Resource, TracerProvider, SpanProcessor, BatchSpanProcessor, SpanExporter, SpanExportResult,
        TraceContextTextMapPropagator,
    )  # fmt: skip


def otlp_exporter(endpoint: str):
    """The OTLP span exporter for `endpoint`, over the protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or
    OTEL_EXPORTER_OTLP_PROTOCOL) names: grpc (vLLM's default) or http/protobuf, where an endpoint without
    the signal path gets /v1/traces (Langfuse's .../api/public/otel). Headers, TLS and timeouts come
    from the SDK's own OTEL_EXPORTER_OTLP_* variables."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint)
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter

            if not urlsplit(endpoint).path.rstrip("/").endswith("/v1/traces"):
                endpoint = endpoint.rstrip("/") + "/v1/traces"
            return HTTPSpanExporter(endpoint=endpoint)
    except ImportError as e:
        raise ConfigError(
            f"--otlp-traces-endpoint needs the OTLP exporter ({e.name} is missing): {TRACING_EXTRA}"
        ) from None
    raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf, got {protocol!r}")


class RequestTracer:
    """Makes and exports the spans of requests; its own TracerProvider (nothing global is touched)."""

    def __init__(self, options: TraceOptions) -> None:
        sdk = _sdk()
        trace, Resource, TracerProvider, SpanProcessor, BatchSpanProcessor, SpanExporter, ExportResult, Propagator = sdk
        self.options = options
        self._trace = trace
        self._propagator = Propagator()
        self._lock = threading.Lock()
        self._pending = 0  # spans handed to the batch processor and not yet exported (or failed)
        self._dropped = 0
        tracer = self

        # The SDK is an optional extra, imported when a tracer is made: its classes are values here.
        class CountingExporter(SpanExporter):  # type: ignore[misc, valid-type]
            """Counts what the real exporter could not deliver (a collector down, slow or refusing)."""

            def __init__(self, inner) -> None:
                self.inner = inner

            def export(self, spans):
                try:
                    result = self.inner.export(spans)
                except Exception:
                    logger.exception("exporting %d spans failed", len(spans))
                    result = ExportResult.FAILURE
                with tracer._lock:
                    tracer._pending -= len(spans)
                    if result != ExportResult.SUCCESS:
                        tracer._dropped += len(spans)
                return result

            def shutdown(self) -> None:
                self.inner.shutdown()

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return self.inner.force_flush(timeout_millis)

        class BoundedQueue(SpanProcessor):  # type: ignore[misc, valid-type]
            """Ended spans go to the batch processor while fewer than MAX_QUEUED_SPANS wait; the rest are
            dropped and counted (the batch processor's own drops would go uncounted)."""

            def on_end(self, span) -> None:
                with tracer._lock:
                    if tracer._pending >= MAX_QUEUED_SPANS:
                        tracer._dropped += 1
                        return
                    tracer._pending += 1
                tracer._processor.on_end(span)

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return tracer._processor.force_flush(timeout_millis)

            def shutdown(self) -> None:
                tracer._processor.shutdown()

        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "tachyllm")})
        # At exit the provider shuts the processors down: what is queued is exported first.
        self._provider = TracerProvider(resource=resource)
        # Its own queue never fills: BoundedQueue stops at the same size first.
        self._processor = BatchSpanProcessor(
            CountingExporter(otlp_exporter(options.endpoint)), max_queue_size=MAX_QUEUED_SPANS
        )
        self._provider.add_span_processor(BoundedQueue())
        self._tracer = self._provider.get_tracer("tachyllm")

    @property
    def dropped_spans(self) -> int:
        """Spans that never reached the collector: the export queue was full, or the export failed."""
        return self._dropped

    def start(self, carrier: Mapping[str, str] | None, start_time: float, name: str = SPAN_NAME, parent=None):
        """A request's span (`llm_request`): a child of `parent`, or of the caller's span when `carrier` (its
        headers) holds a W3C traceparent, else the root of a new trace. End it with finish()."""
        if parent is not None:
            context = self._trace.set_span_in_context(parent)
        else:
            context = self._propagator.extract(carrier) if carrier else None
        return self._tracer.start_span(
            name, context=context, kind=self._trace.SpanKind.SERVER, start_time=_ns(start_time)
        )

    def context_headers(self, span) -> dict[str, str]:
        """The headers that tell the client which trace its request is in."""
        ctx = span.get_span_context()
        return {
            TRACE_ID_HEADER: f"{ctx.trace_id:032x}",
            TRACE_RESPONSE_HEADER: f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}",
        }

    def finish(self, span, request: TracedRequest, end_time: float | None = None) -> None:
        """Adds the request's attributes, child spans and events and ends the span (the batch processor
        exports it). Never raises: no request fails because of its trace."""
        try:
            _annotate(self, span, request)
        except Exception:
            logger.exception("request %s: its trace could not be built", request.request_id)
        finally:
            span.end(end_time=_ns(end_time or time.time()))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Exports what is queued (bounded by the exporter's timeout) and stops the export thread; idempotent."""
        self._provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


SAMPLING_ATTRIBUTES = {  # SamplingParams field -> attribute (vLLM's and the conventions' names agree)
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "seed": "gen_ai.request.seed",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "n": "gen_ai.request.n",
}
FAILED_FINISH_REASONS = ("error", "rejected")


def _annotate(tracer: RequestTracer, span, request: TracedRequest) -> None:
    """The request's attributes, its input-processing span and one engine span per engine request (with
    queue / prefill / decode children and the engine's events)."""
    trace = tracer._trace
    attrs: dict[str, Any] = {"gen_ai.operation.name": request.operation}
    if request.model is not None:
        attrs["gen_ai.request.model"] = attrs["gen_ai.response.model"] = request.model
    if request.request_id is not None:
        attrs["gen_ai.request.id"] = attrs["gen_ai.response.id"] = request.request_id
    if request.params:
        params = request.params[0]
        for name, attr in SAMPLING_ATTRIBUTES.items():
            if (value := getattr(params, name)) is not None:
                attrs[attr] = value
        attrs["gen_ai.request.choice.count"] = params.n
    if request.status_code is not None:
        attrs["http.response.status_code"] = request.status_code
    if request.admitted_time is not None:
        processing = tracer._tracer.start_span(
            "input_processing", context=trace.set_span_in_context(span), start_time=_ns(request.start_time)
        )
        if request.grammar_compile_seconds:
            processing.set_attribute("tachy.grammar_compile_seconds", request.grammar_compile_seconds)
        processing.end(end_time=_ns(request.admitted_time))

    kept = list(request.engine_requests.values())
    errors = [request.error] if request.error else []
    if kept:
        prompt_tokens = sum(len(k.last.prompt_token_ids) for k in kept)
        attrs["gen_ai.usage.prompt_tokens"] = attrs["gen_ai.usage.input_tokens"] = prompt_tokens
        generated = [k.last for k in kept if isinstance(k.last, RequestOutput)]
        if generated:  # a pooling request has no output tokens, samples or finish reasons
            completion_tokens = sum(sum(k.num_tokens.values()) for k in kept)
            reasons = [reason for k in kept for reason in k.reasons]
            attrs.update({
                "gen_ai.usage.completion_tokens": completion_tokens,
                "gen_ai.usage.output_tokens": completion_tokens,
                "gen_ai.usage.num_sequences": len(reasons),
                "gen_ai.usage.cache_read.input_tokens": sum(out.num_cached_tokens for out in generated),
                "gen_ai.response.finish_reasons": reasons,
            })  # fmt: skip
        attrs.update(_latencies([k.last.metrics for k in kept]))
        for k in kept:
            _engine_span(tracer, span, k)
            if k.last.error:
                errors.append(k.last.error)
    if request.record_text:
        prompts = [p for p in request.prompts if p is not None]
        if prompts:
            attrs["gen_ai.prompt"] = prompts[0] if len(prompts) == 1 else prompts
        completions = ["".join(parts) for k in kept for parts in k.texts.values()]
        if completions:
            attrs["gen_ai.completion"] = completions[0] if len(completions) == 1 else completions
    span.set_attributes(attrs)
    for event in request.events:
        span.add_event(event.name, event.attributes, timestamp=_ns(event.time))
    if errors:
        span.set_attribute("error.type", "engine_error" if request.error is None else "request_error")
        span.set_status(trace.Status(trace.StatusCode.ERROR, "; ".join(errors)))


def _latencies(metrics: list[RequestMetrics]) -> dict[str, float]:
    """vLLM's gen_ai.latency.* of the request: of its one engine request, or across several (the first
    token of any, the last to finish, the longest wait)."""
    out: dict[str, float] = {}
    if queues := [m.queue_time for m in metrics if m.queue_time is not None]:
        out["gen_ai.latency.time_in_queue"] = max(queues)
    if ttfts := [m.ttft for m in metrics if m.ttft is not None]:
        out["gen_ai.latency.time_to_first_token"] = min(ttfts)
    if ends := [m.finished_time for m in metrics if m.finished_time is not None]:
        out["gen_ai.latency.e2e"] = max(ends) - min(m.arrival_time for m in metrics)
    prefill = [
        m.first_token_time - m.first_scheduled_time for m in metrics if m.first_token_time and m.first_scheduled_time
    ]
    if prefill:
        out["gen_ai.latency.time_in_model_prefill"] = max(prefill)
    decode = [m.last_token_time - m.first_token_time for m in metrics if m.first_token_time and m.last_token_time]
    if decode:
        out["gen_ai.latency.time_in_model_decode"] = max(decode)
    inference = [
        m.finished_time - m.first_scheduled_time for m in metrics if m.finished_time and m.first_scheduled_time
    ]
    if inference:
        out["gen_ai.latency.time_in_model_inference"] = max(inference)
    steps = [e.attributes["seconds"] for m in metrics for e in (m.events or ()) if e.name == "model_step"]
    if steps:  # detailed traces: the model time of the steps the request was in
        out["gen_ai.latency.time_in_model_forward"] = out["gen_ai.latency.time_in_model_execute"] = sum(steps)
    return out


def _engine_span(tracer: RequestTracer, parent, kept: EngineRequestTrace) -> None:
    """One engine request: arrival to finish, its queue / prefill / decode phases as children, and the
    engine's events (scheduling, prefill chunks, preemptions, first token, steps, the finish). A pooling
    request's prefill runs to its finish: it has no first token and no decode."""
    trace, out = tracer._trace, kept.last
    m = out.metrics
    end = m.finished_time or time.time()
    attributes = {
        "tachy.engine_request_id": out.request_id,
        "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
        "tachy.num_preemptions": sum(1 for e in m.events or () if e.name == "preempted"),
    }
    finished: dict[str, Any] = {}
    if isinstance(out, RequestOutput):
        attributes["gen_ai.usage.completion_tokens"] = sum(kept.num_tokens.values())
        attributes["tachy.prefix_cached_tokens"] = out.num_cached_tokens
        finished["finish_reasons"] = kept.reasons
    engine = tracer._tracer.start_span(
        "engine", context=trace.set_span_in_context(parent), start_time=_ns(m.arrival_time), attributes=attributes
    )
    if m.spec_num_drafts:
        engine.set_attributes({
            "tachy.spec_decode.num_drafts": m.spec_num_drafts,
            "tachy.spec_decode.num_draft_tokens": m.spec_num_draft_tokens,
            "tachy.spec_decode.num_accepted_tokens": m.spec_num_accepted_tokens,
        })  # fmt: skip
    inside = trace.set_span_in_context(engine)
    phases = (
        ("queue", m.arrival_time, m.first_scheduled_time or end),
        ("prefill", m.first_scheduled_time, m.first_token_time or end),
        ("decode", m.first_token_time, end),
    )
    for name, start, stop in phases:
        if start is not None:
            tracer._tracer.start_span(name, context=inside, start_time=_ns(start)).end(end_time=_ns(stop))
    for event in m.events or ():
        engine.add_event(event.name, event.attributes, timestamp=_ns(event.time))
    if m.first_token_time is not None:
        engine.add_event("first_token", {"ttft_seconds": m.ttft}, timestamp=_ns(m.first_token_time))
    engine.add_event("finished", finished, timestamp=_ns(end))
    if out.error:
        engine.set_status(trace.Status(trace.StatusCode.ERROR, out.error))
    engine.end(end_time=_ns(end))
