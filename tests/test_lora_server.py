"""LoRA adapters on the OpenAI-compatible server (docs/lora.md): --lora-modules (name=path and vLLM's JSON
form), an adapter selected by `model` on every endpoint, listed by /v1/models with its parent, an
unknown name answered 404 in OpenAI's shape, and bad flags or adapters refused at start."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import replace

import httpx
import openai
import pytest
from helpers.lora_files import write_adapter, write_gguf_adapter
from helpers.server import serving
from prometheus_client.parser import text_string_to_metric_families

from tachyllm import LLM, SamplingParams
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser
from tachyllm.entrypoints.serve import make_server
from tachyllm.errors import AdapterError, ConfigError
from tachyllm.lora import manager as lora_manager
from tachyllm.lora.request import LoRARequest
from tachyllm.sampling_params import RequestOutputKind
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine
from tachyllm.server.metrics import MetricsOptions, ServerMetrics

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4M", "--log-stats-interval", "0", "--block-size", "4"]
PROMPT = [5, 17, 42, 99, 120, 7, 33]


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def adapter_paths(model_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-adapters")
    qv = write_adapter(root / "qv", model_path, ["q_proj", "v_proj"], seed=11)
    return {
        "qv": str(qv),
        "mlp": str(write_adapter(root / "mlp", model_path, ["gate_proj", "up_proj", "down_proj"], rank=8, seed=12)),
        "qv-gguf": str(write_gguf_adapter(root / "qv.gguf", model_path, qv)),  # the same adapter, llama.cpp's file
    }


def server_args(model_path: str, *flags: str):
    return build_parser().parse_args(["serve", "--model", model_path, "--port", "0", *ENGINE_FLAGS, *flags])


@pytest.fixture(scope="module")
def url(model_path, adapter_paths) -> Iterator[str]:
    mlp = json.dumps({"name": "mlp", "path": adapter_paths["mlp"], "base_model_name": "the-base"})
    args = server_args(
        model_path, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lora-modules", f"qv={adapter_paths['qv']}", mlp, f"qv-gguf={adapter_paths['qv-gguf']}",
    )  # fmt: skip
    server = make_server(build_app(AsyncEngine(lambda: LLMEngine(engine_config(args))), args), args)
    with serving(server) as base:
        yield base


@pytest.fixture(scope="module")
def offline(model_path, adapter_paths) -> dict[str | None, str]:
    """The offline engine's greedy text of PROMPT for the base model and each adapter."""
    llm = LLM(
        model_path,
        dtype="float32",
        kv_cache_memory=4 << 20,
        block_size=4,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    loras = [None, LoRARequest("qv", 1, adapter_paths["qv"]), LoRARequest("mlp", 2, adapter_paths["mlp"])]
    outputs = llm.generate([PROMPT] * 3, params, use_tqdm=False, lora_request=loras)
    return {name: out.outputs[0].text for name, out in zip([None, "qv", "mlp"], outputs)}


def test_models_lists_adapters_with_parent(client, adapter_paths):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "qv", "mlp", "qv-gguf"}
    assert getattr(cards["tiny"], "parent", None) is None
    assert cards["qv"].parent == "tiny" and cards["qv"].root == adapter_paths["qv"]
    assert cards["mlp"].parent == "the-base" and cards["mlp"].root == adapter_paths["mlp"]
    assert cards["qv-gguf"].parent == "tiny" and cards["qv-gguf"].root == adapter_paths["qv-gguf"]
    assert client.models.retrieve("qv").parent == "tiny"


@pytest.mark.parametrize("name", ["qv", "mlp", "tiny", "qv-gguf"])
def test_completion_runs_the_adapter(name, client, offline):
    out = client.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.model == name
    assert out.choices[0].text == offline[{"tiny": None, "qv-gguf": "qv"}.get(name, name)]
    assert offline["qv"] != offline[None] and offline["mlp"] != offline[None]


def test_streamed_chat_and_responses_with_adapter(client):
    messages = [{"role": "user", "content": "hello there"}]
    plain = client.chat.completions.create(model="qv", messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model="qv", messages=messages, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert plain.model == "qv" and streamed == plain.choices[0].message.content
    base = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert base.choices[0].message.content != plain.choices[0].message.content
    response = client.responses.create(model="qv", input="hello there", max_output_tokens=8, temperature=0)
    assert response.model == "qv" and response.status in ("completed", "incomplete")  # 8 tokens may end it
    base_response = client.responses.create(model="tiny", input="hello there", max_output_tokens=8, temperature=0)
    assert response.output_text != base_response.output_text


def test_tokenize_takes_an_adapter_name(http):
    for name in ("qv", "tiny"):
        answer = http.post("/tokenize", json={"model": name, "prompt": "hello there"})
        assert answer.status_code == 200, answer.text
    assert http.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404


def test_unknown_adapter_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model" and "'no-such-adapter'" in body["message"]
    # the server goes on serving
    assert client.completions.create(model="qv", prompt="hi", max_tokens=2).choices[0].text is not None


def start_app(model_path: str, *flags: str) -> None:
    """Builds the server's app (and its engine), which must refuse the flags; the engine is shut down."""
    args = server_args(model_path, *flags)
    engine = AsyncEngine(lambda: LLMEngine(engine_config(args)))
    try:
        build_app(engine, args)
    finally:
        engine.shutdown()


def test_lora_modules_need_enable_lora(model_path, adapter_paths):
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        start_app(model_path, "--lora-modules", f"qv={adapter_paths['qv']}")


def test_bad_adapter_stops_the_server_at_start(model_path, model_path_dir_adapter):
    with pytest.raises(AdapterError, match="use_dora=True is not supported"):
        start_app(model_path, "--enable-lora", "--lora-modules", f"bad={model_path_dir_adapter}")


@pytest.fixture
def model_path_dir_adapter(model_path, tmp_path) -> str:
    return str(write_adapter(tmp_path / "dora", model_path, ["q_proj"], config_overrides={"use_dora": True}))


def test_adapter_name_must_be_new(model_path, adapter_paths):
    with pytest.raises(ConfigError, match="the name 'tiny' is already served"):
        start_app(
            model_path, "--served-model-name", "tiny", "--enable-lora", "--lora-modules", f"tiny={adapter_paths['qv']}"
        )


@pytest.mark.parametrize(
    "value, message",
    [
        ("no-equals-sign", "expected --lora-modules name=path"),
        ('{"name": "a"}', 'needs "name" and "path"'),
        ('{"name": "a", "path": "p", "extra": 1}', 'needs "name" and "path"'),
        ('{"name": "a", "path": ""}', "must be non-empty strings"),
        ("{not json", "invalid JSON"),
    ],
)
def test_lora_modules_flag_refuses_bad_values(value, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", value])
    assert message in capsys.readouterr().err


def lora_info_samples(text: bytes, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value) for f in text_string_to_metric_families(text.decode()) for s in f.samples if s.name == name
    ]


def test_lora_requests_info_metric(model_path, adapter_paths):
    """vLLM's lora_requests_info: max_loras and the adapters of the running and the waiting requests."""
    llm = LLM(model_path, dtype="float32", kv_cache_memory=4 << 20, block_size=4, enable_lora=True, max_cpu_loras=2)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("a", PROMPT, params, lora_request=LoRARequest("qv", 1, adapter_paths["qv"]))
    eng.add_request("b", PROMPT, params, lora_request=LoRARequest("mlp", 2, adapter_paths["mlp"]))
    eng.add_request("c", PROMPT, params)
    eng.step()  # max_loras=1: "mlp" waits while "qv" runs
    metrics = ServerMetrics("tiny", 256, MetricsOptions("vllm"))
    ((labels, value),) = lora_info_samples(metrics.render(eng.snapshot()), "vllm:lora_requests_info")
    assert labels == {
        "model_name": "tiny", "engine": "0", "max_lora": "1", "running_lora_adapters": "qv",
        "waiting_lora_adapters": "mlp",
    }  # fmt: skip
    assert value > 1e9  # the time it was read, as vLLM's
    while eng.has_unfinished_requests():
        eng.step()
    ((labels, _),) = lora_info_samples(metrics.render(eng.snapshot()), "vllm:lora_requests_info")
    assert labels["running_lora_adapters"] == "" and labels["waiting_lora_adapters"] == ""
    plain = LLM(model_path, dtype="float32", kv_cache_memory=4 << 20)
    assert not lora_info_samples(ServerMetrics("tiny", 256).render(plain.engine.snapshot()), "tachy:lora_requests_info")


def test_per_adapter_request_counters_and_load_times(model_path, adapter_paths):
    """lora_requests_total per adapter name and the load-time histogram, under either prefix."""
    llm = LLM(model_path, dtype="float32", kv_cache_memory=4 << 20, block_size=4, enable_lora=True, max_lora_rank=8)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    qv, gguf = LoRARequest("qv", 1, adapter_paths["qv"]), LoRARequest("qv-gguf", 2, adapter_paths["qv-gguf"])
    for i, lora in enumerate([qv, qv, gguf, None]):
        eng.add_request(f"r{i}", PROMPT, params, lora_request=lora)
    with pytest.raises(AdapterError):  # refused: not counted
        eng.add_request("bad", PROMPT, params, lora_request=LoRARequest("bad", 3, model_path))
    while eng.has_unfinished_requests():
        eng.step()
    for prefix, labels in (("vllm", {"model_name": "tiny", "engine": "0"}), ("tachy", {"model_name": "tiny"})):
        text = ServerMetrics("tiny", 256, MetricsOptions(prefix)).render(eng.snapshot())
        requests = {s["lora_name"]: v for s, v in lora_info_samples(text, f"{prefix}:lora_requests_total")}
        assert requests == {"qv": 2, "qv-gguf": 1}
        ((count_labels, loads),) = lora_info_samples(text, f"{prefix}:lora_adapter_load_seconds_count")
        assert loads == 2 and count_labels == labels  # each adapter loaded once
        ((_, total),) = lora_info_samples(text, f"{prefix}:lora_adapter_load_seconds_sum")
        assert 0 < total < 60
    plain = LLM(model_path, dtype="float32", kv_cache_memory=4 << 20)
    text = ServerMetrics("tiny", 256).render(plain.engine.snapshot())
    assert not lora_info_samples(text, "tachy:lora_requests_total")
    assert not lora_info_samples(text, "tachy:lora_adapter_load_seconds_count")


def test_adapter_files_read_off_the_engine_thread(model_path, adapter_paths, monkeypatch):
    """A slow adapter read (a delay injected into it: it waits until a running stream has made 5 more
    tokens) stalls no running stream: the engine thread keeps stepping while another thread reads, and
    then only installs what was read. Were the engine thread the reader, the stream could not move and
    the read would give up."""
    args = server_args(model_path, "--enable-lora", "--max-lora-rank", "8")
    engine = AsyncEngine(lambda: LLMEngine(engine_config(args)))
    read_started, progressed = threading.Event(), threading.Event()
    readers, waited = [], []
    read = lora_manager.load_adapter

    def slow_read(*a):
        readers.append(threading.current_thread().name)
        read_started.set()
        waited.append(progressed.wait(10))
        return read(*a)

    monkeypatch.setattr(lora_manager, "load_adapter", slow_read)
    delta = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run() -> list[int]:
        base = await engine.add_request("base", engine.input_processor.process(PROMPT, delta), delta)
        tokens, mark = 0, None
        adapter_task = None
        async for out in base:
            tokens += len(out.outputs[0].token_ids)
            if adapter_task is None:
                qv = replace(
                    engine.input_processor.process(PROMPT, delta),
                    lora_request=LoRARequest("qv", 1, adapter_paths["qv"]),
                )
                adapter_task = asyncio.ensure_future(engine.add_request("qv", qv, delta))
            if read_started.is_set():
                mark = tokens if mark is None else mark
                if tokens >= mark + 5:
                    progressed.set()
        stream = await adapter_task
        return [t async for out in stream for t in out.outputs[0].token_ids]

    try:
        adapter_tokens = asyncio.run(run())
    finally:
        engine.shutdown()
    assert waited == [True] and readers and readers[0] != "tachy-engine"
    assert len(adapter_tokens) == 400


def test_metrics_endpoint_has_lora_requests_info(http):
    ((labels, _),) = lora_info_samples(http.get("/metrics").content, "tachy:lora_requests_info")
    assert labels["max_lora"] == "2" and labels["model_name"] == "tiny"


@pytest.fixture(scope="module")
def admin_url(model_path) -> Iterator[str]:
    """A server that loads and unloads adapters at run time (--allow-runtime-lora-updating)."""
    args = server_args(
        model_path, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--allow-runtime-lora-updating",
    )  # fmt: skip
    server = make_server(build_app(AsyncEngine(lambda: LLMEngine(engine_config(args))), args), args)
    with serving(server) as base:
        yield base


@pytest.fixture(scope="module")
def admin(admin_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=admin_url, timeout=60) as c:
        yield c


def complete(http: httpx.Client, model: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return http.post("/v1/completions", json=body)


def test_load_during_a_stream_and_unload(admin, admin_url, adapter_paths, offline):
    client = openai.OpenAI(base_url=f"{admin_url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    loaded = admin.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": adapter_paths["qv"]})
    assert loaded.status_code == 200 and loaded.json()["lora_name"] == "hot"
    finish = None
    for chunk in chunks:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"  # the running stream went on to its end
    assert text.startswith(offline[None])
    answer = complete(admin, "hot")
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == offline["qv"]
    assert {m["id"]: m.get("parent") for m in admin.get("/v1/models").json()["data"]}["hot"] == "tiny"
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "hot"}).status_code == 200
    gone = complete(admin, "hot")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    again = admin.post("/v1/unload_lora_adapter", json={"lora_name": "hot"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"


def test_load_a_gguf_adapter_file(admin, adapter_paths, offline):
    """llama.cpp's GGUF LoRA file through /v1/load_lora_adapter: the same answers as its PEFT folder."""
    body = {"lora_name": "hot-gguf", "lora_path": adapter_paths["qv-gguf"]}
    assert admin.post("/v1/load_lora_adapter", json=body).status_code == 200
    answer = complete(admin, "hot-gguf")
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == offline["qv"]
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "hot-gguf"}).status_code == 200


def test_adapter_loaded_again_is_read_anew(admin, model_path, tmp_path):
    """Unloaded, changed on disk and loaded again under its name: the new weights, no old KV block."""
    path = write_adapter(tmp_path / "v", model_path, ["q_proj", "k_proj"], seed=21)
    assert admin.post("/v1/load_lora_adapter", json={"lora_name": "v", "lora_path": str(path)}).status_code == 200
    first = complete(admin, "v").json()["choices"][0]["text"]
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "v"}).status_code == 200
    write_adapter(tmp_path / "v", model_path, ["q_proj", "k_proj"], seed=22)
    assert admin.post("/v1/load_lora_adapter", json={"lora_name": "v", "lora_path": str(path)}).status_code == 200
    second = complete(admin, "v").json()["choices"][0]["text"]
    llm = LLM(model_path, dtype="float32", kv_cache_memory=4 << 20, block_size=4, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [expected] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest("v", 1, str(path)))
    assert second == expected.outputs[0].text != first
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "v"}).status_code == 200


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"lora_name": "tiny", "lora_path": "x"}, "lora_name", "'tiny' is already served"),
        ({"lora_name": "n", "lora_path": "/nowhere"}, "lora_path", "has no adapter_config.json"),
        ({"lora_name": "n"}, "lora_path", "lora_path"),
        ({"lora_name": "", "lora_path": "x"}, "lora_name", "lora_name"),
    ],
)
def test_load_refuses_bad_requests(body, param, message, admin):
    answer = admin.post("/v1/load_lora_adapter", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert complete(admin, "tiny").status_code == 200


def test_load_refuses_a_bad_adapter(admin, model_path, tmp_path):
    path = write_adapter(tmp_path / "dora", model_path, ["q_proj"], config_overrides={"use_dora": True})
    answer = admin.post("/v1/load_lora_adapter", json={"lora_name": "dora", "lora_path": str(path)})
    assert answer.status_code == 400 and "use_dora=True is not supported" in answer.json()["error"]["message"]
    assert complete(admin, "dora").status_code == 404


def test_unload_refuses_the_base_model(admin):
    answer = admin.post("/v1/unload_lora_adapter", json={"lora_name": "tiny"})
    assert answer.status_code == 400 and "base model" in answer.json()["error"]["message"]


def test_runtime_updating_is_off_by_default(http):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "b"}).status_code == 404


def test_runtime_updating_needs_enable_lora(model_path):
    with pytest.raises(ConfigError, match="--allow-runtime-lora-updating needs --enable-lora"):
        start_app(model_path, "--allow-runtime-lora-updating")
