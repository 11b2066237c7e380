"""Request tracing over OTLP (docs/observability.md), checked against real OTLP receivers (tests/otlp_receiver.py):
the caller's trace continued, the attributes against the response and the engine's metrics, the engine's
events (chunked prefill, preemption), errors, privacy by default, a dead collector, Langfuse's endpoint,
gRPC, and the offline LLM."""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from fastapi.testclient import TestClient
from helpers.pooling_models import make_tiny_bert
from otlp_receiver import Span, grpc_receiver, http_receiver
from prometheus_client.parser import text_string_to_metric_families

from tachyllm import faults
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser
from tachyllm.entrypoints.cli import main as cli_main
from tachyllm.entrypoints.llm import LLM
from tachyllm.entrypoints.serve import check_before_loading
from tachyllm.errors import ConfigError
from tachyllm.otel import RequestTracer, TracedRequest, TraceOptions, otlp_exporter
from tachyllm.runner import kv_cache
from tachyllm.sampling_params import SamplingParams
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4M", "--log-stats-interval", "0"]
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PROMPT = "The quick brown fox jumps"
# What a pooling request's span leaves out: it samples nothing and generates no tokens.
NOTHING_GENERATED = (
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.completion_tokens",
    "gen_ai.response.finish_reasons",
    "gen_ai.latency.time_to_first_token",
    "gen_ai.request.max_tokens",
)


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def embedder_path(tmp_path_factory) -> str:
    return str(make_tiny_bert(tmp_path_factory.mktemp("embedder")))


@pytest.fixture
def http_protocol(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")


@contextmanager
def traced_server(model: str, endpoint: str, *flags: str) -> Iterator[TestClient]:
    args = build_parser().parse_args(
        ["serve", "--model", model, *ENGINE_FLAGS, "--otlp-traces-endpoint", endpoint, *flags]
    )
    engine = AsyncEngine(lambda: LLMEngine(engine_config(args)))
    app = build_app(engine, args)
    try:
        yield TestClient(app, base_url="http://127.0.0.1")
    finally:
        engine.shutdown(10)
        app.state.tracer.shutdown()


def flush(http: TestClient) -> None:
    assert http.app.state.tracer.force_flush()


def children(spans: list[Span], parent: Span, name: str | None = None) -> list[Span]:
    return [s for s in spans if s.parent_span_id == parent.span_id and (name is None or s.name == name)]


def metric(http: TestClient, name: str) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


# -- the server ------------------------------------------------------------------------------------------


def test_caller_trace_continued_with_usage_and_timings(model_path, http_protocol):
    with http_receiver() as (receiver, url), traced_server(model_path, url) as http:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "ignore_eos": True, "seed": 3}
        response = http.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT})
        assert response.status_code == 200
        assert response.headers["x-trace-id"] == TRACE_ID
        flush(http)
        (span,) = receiver.wait_for("llm_request")
        ttft_metric = metric(http, "tachy:time_to_first_token_seconds_sum")
    usage, a = response.json()["usage"], span.attributes
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert response.headers["traceresponse"] == f"00-{TRACE_ID}-{span.span_id}-01"
    assert a["gen_ai.usage.prompt_tokens"] == a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.response.id"] == response.json()["id"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.seed"] == 3
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(ttft_metric, abs=1e-6)
    for name in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode", "e2e"):
        assert a[f"gen_ai.latency.{name}"] >= 0
    assert a["gen_ai.latency.e2e"] <= span.end - span.start + 1e-3
    assert span.status_code != 2

    spans = receiver.trace(TRACE_ID)
    (processing,) = children(spans, span, "input_processing")
    (engine,) = children(spans, span, "engine")
    assert span.start <= processing.start <= processing.end <= engine.start + 1e-3
    phases = {s.name: s for s in children(spans, engine)}
    assert set(phases) == {"queue", "prefill", "decode"}
    assert phases["queue"].end == pytest.approx(phases["prefill"].start, abs=1e-6)
    assert phases["prefill"].end - engine.start == pytest.approx(ttft_metric, abs=1e-3)
    names = [e[0] for e in engine.events]
    assert names[0] == "scheduled" and "prefill_chunk" in names and names[-2:] == ["first_token", "finished"]
    assert "model_step" not in names  # per-step timings only with --collect-detailed-traces
    # Privacy by default: no prompt or output text anywhere in the trace.
    text = response.json()["choices"][0]["message"]["content"]
    for s in spans:
        values = [str(v) for v in s.attributes.values()] + [str(e[2]) for e in s.events]
        assert not any("quick brown" in v or (text and text in v) for v in values), s.name
        assert "gen_ai.prompt" not in s.attributes and "gen_ai.completion" not in s.attributes


def test_new_trace_for_a_request_without_context_and_streams_traced(model_path, http_protocol):
    with http_receiver() as (receiver, url), traced_server(model_path, url) as http:
        body = {"prompt": [PROMPT, "Hello"], "max_tokens": 3, "ignore_eos": True, "stream": True, "n": 2}
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            trace_id = response.headers["x-trace-id"]
            assert "[DONE]" in response.read().decode()
        flush(http)
        (span,) = receiver.wait_for("llm_request")
    assert span.trace_id == trace_id != TRACE_ID and span.parent_span_id == ""
    a = span.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.completion_tokens"] == 2 * 2 * 3 and a["gen_ai.usage.num_sequences"] == 4
    assert a["gen_ai.request.n"] == 2 and a["gen_ai.response.finish_reasons"] == ["length"] * 4
    assert len(children(receiver.trace(trace_id), span, "engine")) == 2  # one per prompt


def test_refused_and_failed_requests_have_error_status(model_path, http_protocol):
    with http_receiver() as (receiver, url), traced_server(model_path, url) as http:
        refused = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": -1})
        assert refused.status_code == 400

        def fail_forward(stage: str, request_ids: list[str]) -> None:
            if stage == "forward":
                raise RuntimeError("injected kernel fault")

        with faults.injected(fail_forward):
            failed = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})  # others unaffected
        assert ok.status_code == 200
        flush(http)
        spans = {s.trace_id: s for s in receiver.wait_for("llm_request", 3)}
    refused_span = spans[refused.headers["x-trace-id"]]
    assert refused_span.status_code == 2 and "max_tokens" in refused_span.status_message
    assert refused_span.attributes["http.response.status_code"] == 400
    failed_span = spans[failed.headers["x-trace-id"]]
    assert failed_span.status_code == 2 and "injected kernel fault" in failed_span.status_message
    assert failed_span.attributes["gen_ai.response.finish_reasons"] == ["error"]
    assert spans[ok.headers["x-trace-id"]].status_code != 2


def test_pooling_requests_traced_with_input_tokens_and_timings(embedder_path, http_protocol):
    texts = ["The quick brown fox", "Paged attention stores keys"]
    with http_receiver() as (receiver, url), traced_server(embedder_path, url) as http:
        calls = {
            "embeddings": ("/v1/embeddings", {"input": texts}),
            "score": ("/v1/score", {"text_1": texts[0], "text_2": texts}),
            "rerank": ("/v1/rerank", {"query": texts[0], "documents": texts}),
        }
        responses = {
            operation: http.post(path, json=body, headers={"traceparent": TRACEPARENT} if path == "/v1/score" else {})
            for operation, (path, body) in calls.items()
        }
        refused = http.post("/v1/embeddings", json={"input": texts, "dimensions": 8})  # no Matryoshka cut
        assert refused.status_code == 400
        flush(http)
        spans = {s.trace_id: s for s in receiver.wait_for("llm_request", 4)}
        engines = receiver.wait_for("engine", 2 + 3 + 3)  # rerank and score by cosine: the query embedded too
        phases = receiver.wait_for("queue", 8) + receiver.wait_for("prefill", 8)
    assert responses["score"].headers["x-trace-id"] == TRACE_ID
    for operation, response in responses.items():
        assert response.status_code == 200, response.text
        span = spans[response.headers["x-trace-id"]]
        a = span.attributes
        assert a["gen_ai.operation.name"] == operation and span.status_code != 2
        assert a["gen_ai.request.id"] == a["gen_ai.response.id"] == response.json()["id"]
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == response.json()["model"]
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        assert a["gen_ai.usage.prompt_tokens"] == a["gen_ai.usage.input_tokens"] == prompt_tokens > 0
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.e2e"] <= span.end - span.start + 1e-3
        assert a["gen_ai.latency.time_in_model_inference"] >= 0
        assert not any(name in a for name in NOTHING_GENERATED), operation
        mine = [e for e in engines if e.parent_span_id == span.span_id]
        assert sum(e.attributes["gen_ai.usage.prompt_tokens"] for e in mine) == prompt_tokens
        for engine in mine:
            assert "gen_ai.usage.completion_tokens" not in engine.attributes
            assert sorted(p.name for p in phases if p.parent_span_id == engine.span_id) == ["prefill", "queue"]
            assert [e[0] for e in engine.events][-1] == "finished"
    assert spans[responses["score"].headers["x-trace-id"]].parent_span_id == PARENT_ID
    refused_span = spans[refused.headers["x-trace-id"]]
    assert refused_span.attributes["gen_ai.operation.name"] == "embeddings"
    assert refused_span.status_code == 2 and "dimensions" in refused_span.status_message


def test_text_recorded_only_with_its_flag(model_path, http_protocol):
    with http_receiver() as (receiver, url), traced_server(model_path, url, "--otlp-traces-record-text") as http:
        body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            response.read()
        flush(http)
        (span,) = receiver.wait_for("llm_request")
    assert span.attributes["gen_ai.prompt"] == PROMPT
    assert isinstance(span.attributes["gen_ai.completion"], str)


def test_unreachable_collector_leaves_requests_unaffected(model_path, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    with traced_server(model_path, "http://127.0.0.1:1") as http:
        for _ in range(3):
            response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
            assert response.status_code == 200 and response.headers["x-trace-id"]
        flush(http)
        assert metric(http, "tachy:trace_spans_dropped_total") >= 3 * 6  # each request: 6 spans


def test_langfuse_endpoint_with_basic_auth_from_the_environment(model_path, monkeypatch):
    # Langfuse's documented set-up: OTLP over HTTP, its /api/public/otel path, Basic auth of the key pair.
    auth = base64.b64encode(b"pk-lf-1234:sk-lf-5678").decode()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"Authorization=Basic {auth}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-llm")
    with http_receiver() as (receiver, url), traced_server(model_path, f"{url}/api/public/otel") as http:
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        flush(http)
        (span,) = receiver.wait_for("llm_request")
    path, headers = receiver.exports[0]
    assert path == "/api/public/otel/v1/traces"
    assert headers["authorization"] == f"Basic {auth}"
    assert span.resource["service.name"] == "my-llm"


def test_grpc_export(model_path, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)  # grpc: vLLM's default
    with grpc_receiver() as (receiver, url), traced_server(model_path, url) as http:
        response = http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers={"traceparent": TRACEPARENT}
        )
        flush(http)
        (span,) = receiver.wait_for("llm_request")
    assert span.trace_id == response.headers["x-trace-id"] == TRACE_ID
    assert span.resource["service.name"] == "tachyllm"


def test_missing_extra_or_bad_protocol_fails_at_start_in_one_line(model_path, monkeypatch):
    args = build_parser().parse_args(["serve", "--model", model_path, "--otlp-traces-endpoint", "http://x:4317"])
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ConfigError) as missing:
        check_before_loading(args)
    assert "tachyllm[tracing]" in str(missing.value) and "\n" not in str(missing.value)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="grpc or http/protobuf"):
        otlp_exporter("http://x:4318")


# -- the engine and the offline API ----------------------------------------------------------------------


def test_tracing_options_are_checked():
    with pytest.raises(ConfigError, match="needs otlp_traces_endpoint"):
        EngineConfig(collect_detailed_traces="model")
    with pytest.raises(ConfigError, match="needs otlp_traces_endpoint"):
        EngineConfig(otlp_traces_record_text=True)
    with pytest.raises(ConfigError, match="collect_detailed_traces must be one of"):
        EngineConfig(otlp_traces_endpoint="http://x:4317", collect_detailed_traces="everything")


def test_untraced_requests_record_no_events(model_path):
    llm = LLM(model_path, dtype="float32", kv_cache_memory=4 << 20)
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.metrics.events is None


def test_offline_one_trace_per_call_with_chunks_preemptions_and_step_timings(model_path, http_protocol):
    max_len, block_size = 64, 4
    llm0 = LLM(model_path, dtype="float32", kv_cache_memory=4 << 20)
    block_bytes = kv_cache.bytes_per_block(llm0.engine.model_config, block_size, torch.float32)
    del llm0
    prompts = [[5 + (7 * i + j) % 250 for j in range(20)] for i in range(4)] + ["x" * 10_000]
    params = SamplingParams(max_tokens=max_len - 20, temperature=0, ignore_eos=True)
    with http_receiver() as (receiver, url):
        # Room for two max-length sequences, 8-token prefill chunks: four prompts preempt each other.
        llm = LLM(
            model_path, dtype="float32", block_size=block_size, max_model_len=max_len,
            kv_cache_memory=2 * (max_len // block_size) * block_bytes, max_num_batched_tokens=8,
            otlp_traces_endpoint=url, collect_detailed_traces="model",
        )  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]] + prompts[4:], params, use_tqdm=False)
        second = llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm._tracer.force_flush()
        requests = receiver.wait_for("llm_request", 6)
        llm._tracer.shutdown()
    assert llm.engine.stats.num_preemptions > 0
    roots = receiver.wait_for("llm_generate", 2)
    assert len({r.trace_id for r in roots}) == 2
    (later,) = [s for s in requests if s.attributes["gen_ai.request.id"] == second[0].request_id]
    (first_root,) = [r for r in roots if r.trace_id != later.trace_id]
    call = [s for s in requests if s.trace_id == first_root.trace_id]
    assert len(call) == 5 and all(s.parent_span_id == first_root.span_id for s in call)
    by_id = {s.attributes["gen_ai.request.id"]: s for s in call}
    preemptions = 0
    for out in outputs[:4]:
        span = by_id[out.request_id]
        assert span.attributes["gen_ai.usage.completion_tokens"] == len(out.outputs[0].token_ids) == max_len - 20
        assert span.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(out.metrics.ttft, abs=1e-6)
        assert span.attributes["gen_ai.latency.time_in_model_forward"] > 0
        (engine,) = children(receiver.trace(span.trace_id), span, "engine")
        chunks = [e[2] for e in engine.events if e[0] == "prefill_chunk"]
        first_prefill = chunks[: next(i for i, c in enumerate(chunks) if c["start"] + c["tokens"] >= 20) + 1]
        assert len(first_prefill) >= 3 and sum(c["tokens"] for c in first_prefill) == 20  # 8-token chunks
        names = [e[0] for e in engine.events]
        assert names.count("preempted") == names.count("resumed") == engine.attributes["tachy.num_preemptions"]
        assert names.count("model_step") >= max_len - 20
        preemptions += engine.attributes["tachy.num_preemptions"]
    assert preemptions == llm.engine.stats.num_preemptions
    refused = by_id[outputs[4].request_id]
    assert refused.status_code == 2 and outputs[4].error in refused.status_message
    assert second[0].outputs[0].finish_reason is not None


def test_events_outside_the_engine_reach_the_request_span(http_protocol):
    """Ray Serve's ingress records where a request was sent and its retries on the request's trace."""
    with http_receiver() as (receiver, url):
        tracer = RequestTracer(TraceOptions(url))
        request = TracedRequest(time.time(), "chat")
        span = tracer.start(None, request.start_time)
        request.record("routed", engine_request_id="r", attempt=0)
        request.record("retry", reason="its replica died", attempt=1)
        tracer.finish(span, request)
        assert tracer.force_flush()
        (got,) = receiver.wait_for("llm_request")
        tracer.shutdown()
    assert [(e[0], e[2]) for e in got.events] == [
        ("routed", {"engine_request_id": "r", "attempt": 0}),
        ("retry", {"reason": "its replica died", "attempt": 1}),
    ]


def test_offline_spans_are_exported_at_exit(model_path, http_protocol):
    """A script that generates and exits: its spans still reach the collector (the provider flushes at exit)."""
    script = (
        "from tachyllm.entrypoints.llm import LLM\n"
        "from tachyllm.sampling_params import SamplingParams\n"
        f"llm = LLM({model_path!r}, dtype='float32', kv_cache_memory=4 << 20, otlp_traces_endpoint=URL)\n"
        "llm.generate(['Hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
    )
    with http_receiver() as (receiver, url):
        done = subprocess.run(
            [sys.executable, "-c", f"URL = {url!r}\n" + script], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        (span,) = receiver.wait_for("llm_request", timeout=5)
    assert span.attributes["gen_ai.usage.completion_tokens"] == 2


def test_responses_api_and_grammar_compile_traced(model_path, http_protocol):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with http_receiver() as (receiver, url), traced_server(model_path, url) as http:
        answer = http.post("/v1/responses", json={"input": PROMPT, "max_output_tokens": 3})
        assert answer.status_code == 200
        body = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        }
        constrained = http.post("/v1/chat/completions", json=body)
        assert constrained.status_code == 200
        flush(http)
        spans = {s.trace_id: s for s in receiver.wait_for("llm_request", 2)}
        processing = receiver.wait_for("input_processing", 2)
    response_span = spans[answer.headers["x-trace-id"]]
    assert response_span.attributes["gen_ai.operation.name"] == "chat"
    assert response_span.attributes["gen_ai.usage.output_tokens"] == answer.json()["usage"]["output_tokens"]
    (compiled,) = [p for p in processing if p.trace_id == constrained.headers["x-trace-id"]]
    assert compiled.attributes["tachy.grammar_compile_seconds"] > 0


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_terminal_commands_refuse_the_tracing_flag(model_path, command, capsys):
    argv = [command, "--model", model_path, "--otlp-traces-endpoint", "http://x:4317"]
    assert cli_main(argv + (["Hello"] if command == "generate" else [])) == 2
    assert "tachy generate and tachy chat export no traces" in capsys.readouterr().err


def test_speculative_decoding_totals_on_the_engine_span(model_path, http_protocol):
    prompt = [7, 8, 9, 10] * 12  # n-gram lookup finds drafts in a repeating prompt
    with http_receiver() as (receiver, url):
        llm = LLM(
            model_path, dtype="float32", kv_cache_memory=4 << 20, otlp_traces_endpoint=url,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        )  # fmt: skip
        (out,) = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False
        )
        assert llm._tracer.force_flush()
        (engine,) = receiver.wait_for("engine")
        llm._tracer.shutdown()
    m = out.metrics
    assert m.spec_num_drafts > 0
    assert engine.attributes["tachy.spec_decode.num_drafts"] == m.spec_num_drafts
    assert engine.attributes["tachy.spec_decode.num_draft_tokens"] == m.spec_num_draft_tokens
    assert engine.attributes["tachy.spec_decode.num_accepted_tokens"] == m.spec_num_accepted_tokens
