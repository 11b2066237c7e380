"""/metrics under vLLM's exact names and labels (--metrics-prefix vllm), so that vLLM's example Grafana
dashboard works unchanged; the request length histograms under both prefixes; and our own dashboard
(docs/grafana/tachyllm.json) querying only what /metrics exports."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine
from tachyllm.server.metrics import token_buckets

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4M", "--log-stats-interval", "0"]
DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "tachyllm.json"

# Every series vLLM's example dashboard (examples/observability/prometheus_grafana/grafana.json) queries,
# each filtered by {model_name="$model_name"} (its template variable: label_values(model_name)); the
# finish-reason panel sums by finished_reason. gpu_cache_usage_perc is what its older versions query.
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# The rest of vLLM's names that users compare against (vLLM's metrics documentation).
VLLM_OTHER_SERIES = [
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@contextmanager
def app_client(model: str, *flags: str) -> Iterator[TestClient]:
    args = build_parser().parse_args(["serve", "--model", model, *ENGINE_FLAGS, *flags])
    engine = AsyncEngine(lambda: LLMEngine(engine_config(args)))
    try:
        yield TestClient(build_app(engine, args), base_url="http://127.0.0.1")
    finally:
        engine.shutdown(10)


def scrape(http: TestClient) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> (labels, value) of every sample /metrics serves."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def one(samples, name: str, **labels: str) -> float:
    (value,) = [v for got, v in samples[name] if all(got.get(k) == want for k, want in labels.items())]
    return value


def run_request(http: TestClient, prompt: str = "The quick brown fox") -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "n": 2, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    return response.json()["usage"]


def test_vllm_names_and_labels(model_path):
    with app_client(model_path, "--metrics-prefix", "vllm", "--served-model-name", "smol") as http:
        usage = run_request(http)
        samples = scrape(http)
    assert not [name for name in samples if name.startswith("tachy:")]
    for name in VLLM_DASHBOARD_SERIES + VLLM_OTHER_SERIES:
        assert name in samples, f"{name} is missing from /metrics"
    for name, series in samples.items():
        if name.startswith("vllm:"):
            for labels, _ in series:
                assert labels["model_name"] == "smol" and labels["engine"] == "0", (name, labels)
    # Each of the n = 2 samples is counted, as vLLM counts them; the longest sample once per request.
    assert one(samples, "vllm:request_success_total", finished_reason="length") == 2
    assert one(samples, "vllm:request_prompt_tokens_sum") == 2 * usage["prompt_tokens"]
    assert one(samples, "vllm:request_generation_tokens_sum") == usage["completion_tokens"] == 8
    assert one(samples, "vllm:request_max_num_generation_tokens_sum") == 4
    assert one(samples, "vllm:request_max_num_generation_tokens_count") == 1
    assert one(samples, "vllm:request_prompt_tokens_bucket", le="+Inf") == 2
    assert one(samples, "vllm:generation_tokens_total") == 8
    assert one(samples, "vllm:e2e_request_latency_seconds_count") == 1
    assert one(samples, "vllm:kv_cache_usage_perc") == one(samples, "vllm:gpu_cache_usage_perc")


def test_tachy_names_keep_their_labels_and_gain_the_length_histograms(model_path, caplog):
    with caplog.at_level(logging.INFO, logger="tachyllm.server"):
        with app_client(model_path) as http:
            usage = run_request(http)
            samples = scrape(http)
    assert "finished: length" in caplog.text  # the request log line, on by default
    assert not [name for name in samples if name.startswith("vllm:")]
    for name in VLLM_DASHBOARD_SERIES:
        ours = name.replace("vllm:", "tachy:")
        if ours != "tachy:gpu_cache_usage_perc":  # the old name is exported with the vllm prefix only
            assert ours in samples, ours
    assert one(samples, "tachy:request_prompt_tokens_sum") == 2 * usage["prompt_tokens"]
    assert one(samples, "tachy:request_generation_tokens_sum") == 8
    assert all("engine" not in labels for series in samples.values() for labels, _ in series)
    buckets = [float(labels["le"]) for labels, _ in samples["tachy:request_prompt_tokens_bucket"][:-1]]
    assert buckets == token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]


def test_disable_log_requests(model_path, caplog):
    with caplog.at_level(logging.INFO, logger="tachyllm.server"):
        with app_client(model_path, "--disable-log-requests") as http:
            run_request(http)
            scrape(http)
    assert "finished:" not in caplog.text


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def test_our_dashboard_queries_only_exported_series(model_path):
    queries = dashboard_queries()
    assert len(queries) >= 16
    used = {name for expr in queries for name in re.findall(r"tachy:[a-z0-9_]+", expr)}
    for wanted in ("time_to_first_token", "kv_cache_usage_perc", "prefix_cache_hits", "spec_decode_num_accepted"):
        assert any(wanted in name for name in used), wanted
    spec = '{"method": "draft_model", "model": "self:layers=1", "num_speculative_tokens": 3, "adaptive": false}'
    with app_client(model_path, "--speculative-config", spec) as http:
        body = {"prompt": "one two one two one two one two", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200
        samples = scrape(http)
        families = {family.name for family in text_string_to_metric_families(http.get("/metrics").text)}
    assert samples["tachy:spec_decode_num_draft_tokens_total"][0][1] > 0
    for name in sorted(used):
        if name == "tachy:spec_decode_num_accepted_tokens_per_pos_total":
            # A series per position appears with the first token accepted there (a random draft model
            # may have none); the family is declared from the start.
            assert "tachy:spec_decode_num_accepted_tokens_per_pos" in families
            continue
        assert name in samples, f"the dashboard queries {name}, which /metrics does not export"
        assert all("model_name" in labels for labels, _ in samples[name])
    for expr in queries:  # every selector filters by the dashboard's model variable
        assert all(sel == '{model_name=~"$model_name"}' for sel in re.findall(r"\{[^}]*\}", expr.replace("{{", "")))


def test_vllm_request_parameter_cache_and_step_families(model_path):
    """vLLM's request_params_*, prompt_tokens_cached, request_prefill_kv_computed_tokens,
    request_num_preemptions, iteration_tokens_total, num_requests_waiting_by_reason and cache_config_info."""
    with app_client(model_path, "--metrics-prefix", "vllm", "--served-model-name", "smol", "--block-size", "4") as http:
        prompt = "The quick brown fox jumps over the lazy dog. " * 2
        usage = run_request(http, prompt)
        run_request(http, prompt)  # the same prompt again: its full blocks come from the prefix cache
        samples = scrape(http)
    for name in ("vllm:request_params_n_sum", "vllm:iteration_tokens_total_count", "vllm:cache_config_info"):
        assert all(labels["model_name"] == "smol" and labels["engine"] == "0" for labels, _ in samples[name])
    assert one(samples, "vllm:request_params_n_count") == 2 and one(samples, "vllm:request_params_n_sum") == 4
    assert one(samples, "vllm:request_params_n_bucket", le="1.0") == 0
    assert one(samples, "vllm:request_params_n_bucket", le="2.0") == 2
    assert one(samples, "vllm:request_params_max_tokens_sum") == 8
    cached = one(samples, "vllm:prompt_tokens_cached_total")
    assert 0 < cached < 2 * usage["prompt_tokens"] and cached % 4 == 0
    assert one(samples, "vllm:request_prefill_kv_computed_tokens_sum") == 2 * usage["prompt_tokens"] - cached
    assert one(samples, "vllm:request_num_preemptions_count") == 2
    assert one(samples, "vllm:request_num_preemptions_sum") == 0
    steps = one(samples, "vllm:iteration_tokens_total_count")
    assert steps >= 2 * 4 and one(samples, "vllm:iteration_tokens_total_bucket", le="+Inf") == steps
    # Every generated token and every computed prompt token was some step's.
    assert one(samples, "vllm:iteration_tokens_total_sum") >= 16 + 2 * usage["prompt_tokens"] - cached
    assert one(samples, "vllm:iteration_tokens_total_bucket", le="1.0") <= steps
    assert one(samples, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert one(samples, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    ((labels, value),) = samples["vllm:cache_config_info"]
    assert value == 1 and labels["block_size"] == "4" and labels["enable_prefix_caching"] == "True"
    assert int(labels["num_gpu_blocks"]) > 0 and labels["cache_dtype"] == "auto"


def test_request_preemptions_are_counted(model_path):
    """A KV cache of 16 blocks for n = 6 samples of 8 blocks each (sampled, so that they differ and share no
    blocks): some are preempted, and the request's histogram counts them as vllm:num_preemptions_total does."""
    with app_client(model_path, "--metrics-prefix", "vllm", "--kv-cache-memory", "32K", "--block-size", "4") as http:
        body = {"prompt": "The quick brown fox", "max_tokens": 26, "n": 6, "seed": 0, "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        samples = scrape(http)
    assert response.status_code == 200, response.text
    total = one(samples, "vllm:num_preemptions_total")
    assert total > 0
    assert one(samples, "vllm:request_num_preemptions_sum") == total
