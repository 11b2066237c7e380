"""vLLM's command line: `tachy serve MODEL`, vLLM's flag spellings and
server flags (CORS, --root-path, --generation-config, --gpu-memory-utilization, log levels), and
failures told in one line before the model loads."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from helpers.models import make_tiny_model
from helpers.server import free_port

from tachyllm import LLM, SamplingParams
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser
from tachyllm.entrypoints.serve import apply_model_tag, bind_socket, make_server
from tachyllm.errors import ConfigError
from tachyllm.loading.generation_config import default_sampling_values
from tachyllm.ray_serve.config import engine_options
from tachyllm.runner.kv_cache import default_kv_cache_memory
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4M", "--log-stats-interval", "0"]
GENERATION_CONFIG = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "repetition_penalty": 1.1, "max_new_tokens": 3}


@pytest.fixture(scope="module")
def gen_model(tmp_path_factory) -> str:
    """A tiny HF model whose generation_config.json recommends sampling values."""
    directory = make_tiny_model(tmp_path_factory.mktemp("gen-model"))
    document = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**document, **GENERATION_CONFIG}))
    return str(directory)


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


# -- flags -------------------------------------------------------------------------------------


def test_the_model_is_positional_as_in_vllm_serve():
    args = serve_args("m.gguf", "--port", "9000")
    apply_model_tag(args)
    assert (args.model, args.model_all, args.port) == ("m.gguf", ["m.gguf"], 9000)
    args = serve_args("m.gguf", "--model", "m.gguf")  # the same twice is fine
    apply_model_tag(args)
    assert args.model == "m.gguf"
    args = serve_args("--model", "b.gguf")
    apply_model_tag(args)
    assert args.model == "b.gguf"
    with pytest.raises(ConfigError, match=r"the model is given twice, as a.gguf and as --model b.gguf"):
        apply_model_tag(serve_args("a.gguf", "--model", "b.gguf"))


def test_a_vllm_serve_command_line_parses():
    args = serve_args(
        "m", "--enable-prefix-caching", "--enable-chunked-prefill", "--dtype", "half", "--generation-config", "vllm",
        "--gpu-memory-utilization", "0.8", "--root-path", "/llm", "--allowed-origins", '["https://a.example"]',
        "--allowed-methods", '["GET"]', "--allowed-headers", "X-A", "X-B", "--allow-credentials",
        "--disable-log-requests", "--uvicorn-log-level", "warning", "--vllm-metrics",
    )  # fmt: skip
    config = engine_config(args)
    assert (config.enable_prefix_caching, config.enable_chunked_prefill) == (True, True)
    assert (config.dtype, config.generation_config, config.gpu_memory_utilization) == ("float16", "vllm", 0.8)
    assert args.root_path == "/llm" and args.allowed_origins == ["https://a.example"]
    assert (args.allowed_methods, args.allowed_headers, args.allow_credentials) == (["GET"], ["X-A", "X-B"], True)
    assert (args.disable_log_requests, args.uvicorn_log_level, args.metrics_prefix) == (True, "warning", "vllm")
    assert serve_args("--metrics-prefix", "vllm").metrics_prefix == "vllm"
    assert serve_args().metrics_prefix == "tachy" and serve_args().allowed_origins is None


@pytest.mark.parametrize(
    "alias, dtype", [("half", torch.float16), ("float", torch.float32), ("float16", torch.float16)]
)
def test_dtype_takes_vllms_aliases(alias, dtype):
    assert EngineConfig(dtype=alias).resolve_dtype() == dtype
    assert engine_config(build_parser().parse_args(["generate", "hi", "--dtype", alias])).resolve_dtype() == dtype


def test_models_yaml_takes_the_new_engine_options():
    config = engine_options(
        {"enable_prefix_caching": True, "dtype": "half", "generation_config": "vllm", "gpu_memory_utilization": 0.5},
        "models[0]",
    )
    assert (config.enable_prefix_caching, config.dtype, config.generation_config) == (True, "float16", "vllm")
    assert config.gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        engine_options({"gpu_memory_utilization": 1.5}, "models[0]")


def test_gpu_memory_utilization_is_checked_and_ignored_on_the_cpu(caplog):
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
            EngineConfig(gpu_memory_utilization=bad)
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        assert default_kv_cache_memory(torch.device("cpu"), 1 << 20, 0.5) <= 1 << 20
    assert "--gpu-memory-utilization applies to a CUDA device: ignored on the CPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tachyllm"):
        default_kv_cache_memory(torch.device("cpu"), 1 << 20)
    assert "gpu-memory-utilization" not in caplog.text


@pytest.mark.gpu
def test_gpu_memory_utilization_sizes_the_kv_cache_on_cuda(gen_model):
    device = torch.device("cuda")
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    # A share that leaves 32 MiB above what is in use now: the KV cache gets those 32 MiB.
    share = (total - free + (32 << 20)) / total
    assert abs(default_kv_cache_memory(device, 1 << 40, share) - (32 << 20)) < 4 << 20
    assert default_kv_cache_memory(device, 1 << 20, 0.9) == 1 << 20  # never more than the sequences need
    with pytest.raises(ConfigError, match="leaves no room for the KV cache"):
        default_kv_cache_memory(device, 1 << 20, (total - free) / total / 2)
    llm = LLM(gen_model, dtype="float32", device="cuda", gpu_memory_utilization=0.9, max_num_seqs=4)
    assert llm.engine.block_manager.num_blocks == 4 * 512 // 16  # what 4 full-length sequences need


def test_uvicorn_log_level_sets_uvicorns_loggers():
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn.access")]
    before = [lg.level for lg in loggers]
    app = FastAPI()
    app.state.server = None
    try:
        make_server(app, serve_args("--uvicorn-log-level", "warning"))
        assert [lg.level for lg in loggers] == [logging.WARNING, logging.WARNING]
        for lg in loggers:
            lg.setLevel(logging.NOTSET)
        make_server(app, serve_args())  # by default they follow tachy's --log-level (the root logger)
        assert [lg.level for lg in loggers] == [logging.NOTSET, logging.NOTSET]
    finally:
        for lg, level in zip(loggers, before):
            lg.setLevel(level)


# -- generation config -------------------------------------------------------------------------


def test_generation_config_values(gen_model, tmp_path, default_model_path):
    expected = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 3}
    assert default_sampling_values("auto", gen_model) == expected
    assert default_sampling_values("vllm", gen_model) == {}
    assert default_sampling_values("auto", default_model_path) == {}  # a GGUF file has none
    assert default_sampling_values("auto", None) == {}
    folder = tmp_path / "gc"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 0, "min_p": 0.1, "do_sample": True}))
    assert default_sampling_values(str(folder), None) == {"top_k": -1, "min_p": 0.1}  # HF's 0 = off
    with pytest.raises(ConfigError, match="holds no generation_config.json"):
        default_sampling_values(str(tmp_path), gen_model)
    with pytest.raises(ConfigError, match="is not auto, vllm or a folder"):
        default_sampling_values(str(tmp_path / "nope"), gen_model)
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 3}))
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        default_sampling_values(str(folder), None)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2.5}))
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer"):
        default_sampling_values(str(folder), None)


def test_offline_default_sampling_params(gen_model):
    llm = LLM(gen_model, dtype="float32", kv_cache_memory=4 << 20)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.8, 7, 3)
    assert params.repetition_penalty == 1.1
    (out,) = llm.generate("The quick brown fox", use_tqdm=False)  # no sampling_params: the model's defaults
    assert len(out.outputs[0].token_ids) == 3 or out.outputs[0].finish_reason == "stop"
    plain = LLM(gen_model, dtype="float32", kv_cache_memory=4 << 20, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


@contextmanager
def app_client(model: str, *flags: str) -> Iterator[tuple[TestClient, list[SamplingParams]]]:
    """An app over its own engine, through Starlette's test client (Host 127.0.0.1), and the
    SamplingParams of every request the engine was given."""
    args = serve_args("--model", model, *ENGINE_FLAGS, *flags)
    engine = AsyncEngine(lambda: LLMEngine(engine_config(args)))
    seen: list[SamplingParams] = []
    add_requests = engine.add_requests

    async def recording(requests, *rest, **options):
        seen.extend(params for _, _, params in requests)
        return await add_requests(requests, *rest, **options)

    engine.add_requests = recording
    try:
        yield TestClient(build_app(engine, args), base_url="http://127.0.0.1"), seen
    finally:
        engine.shutdown(10)


def test_generation_config_defaults_apply_to_requests_that_leave_fields_unset(gen_model):
    with app_client(gen_model) as (http, seen):
        assert http.post("/v1/completions", json={"prompt": "hello"}).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        for params in seen:
            assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.8, 7, 3)
            assert params.repetition_penalty == 1.1
        seen.clear()
        given = {"temperature": 0, "top_p": 1, "top_k": 0, "repetition_penalty": 1.0, "max_tokens": 5}
        assert http.post("/v1/completions", json={"prompt": "hello", **given}).status_code == 200
        assert http.post("/v1/chat/completions", json={**chat, **given}).status_code == 200
        for params in seen:
            assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 1.0, -1, 5)
            assert params.repetition_penalty == 1.0
    with app_client(gen_model, "--generation-config", "vllm") as (http, seen):
        assert http.post("/v1/completions", json={"prompt": "hello"}).status_code == 200
        (params,) = seen
        assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1) and params.max_tokens > 3


# -- HTTP: CORS and root path ------------------------------------------------------------------

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-trace"}


def test_cors_is_off_by_default_and_follows_the_flags(gen_model):
    with app_client(gen_model) as (http, _):
        assert "access-control-allow-origin" not in http.options("/v1/completions", headers=PREFLIGHT).headers
        assert "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": ORIGIN}).headers
    flags = ["--allowed-origins", ORIGIN, "--allowed-headers", "Content-Type", "X-Trace", "--allow-credentials"]
    with app_client(gen_model, *flags) as (http, _):
        answer = http.options("/v1/completions", headers=PREFLIGHT)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
        assert answer.headers["access-control-allow-credentials"] == "true"
        assert "x-trace" in answer.headers["access-control-allow-headers"].lower()
        assert "POST" in answer.headers["access-control-allow-methods"]
        other = http.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        assert http.get("/v1/models", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
        # The guard still holds with CORS on: JSON bodies only, known Host names only.
        text = http.post("/v1/completions", content="{}", headers={"Origin": ORIGIN, "Content-Type": "text/plain"})
        assert text.status_code == 415 and text.headers["access-control-allow-origin"] == ORIGIN
        assert http.get("/v1/models", headers={"Host": "evil.example"}).status_code == 421
    with app_client(gen_model, "--allowed-origins", ORIGIN, "--allowed-methods", "GET") as (http, _):
        assert http.options("/v1/completions", headers=PREFLIGHT).status_code == 400  # POST not allowed


def test_root_path(gen_model):
    with app_client(gen_model, "--root-path", "/llm") as (http, _):
        assert http.get("/llm/v1/models").status_code == 200  # a proxy that keeps the prefix
        assert http.get("/v1/models").status_code == 200  # one that strips it
        assert http.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    with app_client(gen_model) as (http, _):
        assert "servers" not in http.get("/openapi.json").json()


# -- friendly failures (subprocesses: what a user sees) -----------------------------------------


def tachy(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tachyllm.entrypoints.cli", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # a CLI process started per bad flag (~10 s)
def test_bad_startup_is_one_line_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["serve", "--port", "70000"], "tachy serve: error: argument --port: a TCP port is 0-65535"),
            (["serve", "--port", "http"], "tachy serve: error: argument --port: expected a TCP port number"),
            (["serve", "--max-num-seqs", "many"], "tachy serve: error: argument --max-num-seqs: invalid int value"),
            (["serve", "--port", str(port)], f"tachy: error: cannot listen on 127.0.0.1:{port}: the port is in use"),
            (["serve", str(tmp_path / "missing.gguf")], "tachy: error: model path does not exist:"),
        ]
        for argv, message in cases:
            done = tachy(*argv)
            assert done.returncode == 2, (argv, done.stderr)
            assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, (argv, done.stderr)
            assert done.stdout == ""


def test_the_port_is_held_from_the_check_on():
    with bind_socket("127.0.0.1", 0) as first:  # two servers started together: the second fails at once
        port = first.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            bind_socket("127.0.0.1", port)


def test_bench_serve_against_a_server_that_is_down():
    port = free_port()
    done = tachy("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--no-progress")
    assert done.returncode == 2
    assert done.stderr.startswith(f"tachy: error: no server answers at http://127.0.0.1:{port} (ClientConnectorError")
    assert done.stderr.count("\n") == 1 and "is it running?" in done.stderr


def test_generation_config_folder_is_checked_before_loading(tmp_path):
    done = tachy("serve", "--generation-config", str(tmp_path), "--port", "0")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "holds no generation_config.json" in done.stderr


def test_bench_serve_save_detailed_needs_a_result_file():
    done = tachy("bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--save-detailed")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "--save-detailed writes into the --result-json file" in done.stderr
