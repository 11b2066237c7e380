"""Request tracing behind `tachy serve --replicas` (Ray Serve): the ingress continues the caller's trace,
and the replica's engine work (its events, recorded in the outputs' metrics) and the routing are part of
the same trace, received by a real OTLP/gRPC receiver."""

from __future__ import annotations

import socket

import httpx
import pytest
from otlp_receiver import grpc_receiver

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from tachyllm.ray_serve.app import application  # noqa: E402
from tachyllm.ray_serve.config import parse_config  # noqa: E402
from tachyllm.server.options import server_args  # noqa: E402

pytestmark = pytest.mark.slow

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ingress_and_replica_are_one_trace(tiny_model_factory):
    engine = {"dtype": "float32", "kv_cache_memory": "4M", "max_model_len": 256, "max_num_seqs": 4}
    with grpc_receiver() as (receiver, endpoint):
        ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            config = parse_config(
                {
                    "models": [
                        {"name": "tiny", "model": str(tiny_model_factory("llama")), "replicas": 1,
                         "threads_per_replica": 1, "num_cpus": 0.5,
                         "engine": {**engine, "otlp_traces_endpoint": endpoint}},
                    ]
                }
            )  # fmt: skip
            serve.run(application(config, server_args({})), name="traced", route_prefix="/")
            body = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "ignore_eos": True}
            response = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json=body,
                headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                timeout=120,
            )
            assert response.status_code == 200
            assert response.headers["x-trace-id"] == TRACE_ID
            (span,) = receiver.wait_for("llm_request", timeout=60)  # the batch processor sends within ~5 s
        finally:
            serve.shutdown()
            ray.shutdown()
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert span.attributes["gen_ai.usage.completion_tokens"] == response.json()["usage"]["completion_tokens"] == 4
    assert [e[0] for e in span.events] == ["routed"]
    spans = receiver.trace(TRACE_ID)
    (engine_span,) = [s for s in spans if s.name == "engine" and s.parent_span_id == span.span_id]
    names = [e[0] for e in engine_span.events]  # recorded in the replica's engine
    assert names[0] == "scheduled" and "prefill_chunk" in names and names[-2:] == ["first_token", "finished"]
