"""tachyllm on Ray Serve, end to end on a local Ray instance of 2 CPUs: two replicas of a tiny
model and a second model behind one ingress, the openai client streaming through it, prefix-aware
routing of a conversation's turns, the load guard, multi-model routing, per-replica metrics, a replica
killed mid-run, and autoscaling up and down. The tests of one module share the Ray instance and run in
file order (the failure test kills a replica; the autoscaling test replaces the application)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from helpers.lora_files import write_adapter
from helpers.server import free_port

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from tachyllm import LLM  # noqa: E402
from tachyllm.ray_serve import build_app  # noqa: E402
from tachyllm.ray_serve.app import application  # noqa: E402
from tachyllm.ray_serve.config import parse_config  # noqa: E402
from tachyllm.ray_serve.hub import routing_hub  # noqa: E402
from tachyllm.server.options import server_args  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray]

API_KEY = "ray-key"
APP = "tachyllm"
ENGINE = {"dtype": "float32", "kv_cache_memory": "4M", "max_model_len": 512, "max_num_seqs": 4}
LORA_ENGINE = {**ENGINE, "enable_lora": True, "max_lora_rank": 8}
# Long enough for several 16-token blocks; distinct per conversation, so no two share a first block.
SYSTEM = "{i}{i}{i} {i}{i} {i}: you are an assistant. " + "Answer briefly and precisely, in plain words. " * 8


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if m is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def per_replica(text: str, name: str, model: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}{{(.*)}} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.get("model_name") == model and "replica" in labels:
                values[labels["replica"]] = values.get(labels["replica"], 0.0) + float(m.group(2))
    return values


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_instance():
    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def models(tiny_model_factory) -> dict[str, str]:
    return {"tiny": str(tiny_model_factory("llama")), "tiny-qwen": str(tiny_model_factory("qwen2"))}


@pytest.fixture(scope="module")
def adapter_path(models, tmp_path_factory) -> str:
    """A LoRA adapter of the tiny model, served as "tiny-qv" on its replicas."""
    return str(write_adapter(tmp_path_factory.mktemp("ray-lora") / "qv", models["tiny"], ["q_proj", "v_proj"], seed=5))


@pytest.fixture(scope="module")
def base(ray_instance, models, adapter_path) -> str:
    config = parse_config(
        {
            "models": [
                {"name": "tiny", "model": models["tiny"], "replicas": 2, "threads_per_replica": 1, "num_cpus": 0.5,
                 "engine": LORA_ENGINE, "lora_modules": {"tiny-qv": adapter_path}},
                {"name": "tiny-qwen", "model": models["tiny-qwen"], "replicas": 1, "threads_per_replica": 1,
                 "num_cpus": 0.5, "engine": ENGINE},
                # The RAG pair: an embedder next to the chat models, behind the same ingress.
                {"name": "embedder", "model": models["tiny"], "replicas": 1, "threads_per_replica": 1,
                 "num_cpus": 0.25, "engine": {**ENGINE, "runner": "pooling"}},
            ],
            "router": {"load_margin": 3, "event_interval_s": 0.1},
        }
    )  # fmt: skip
    serve.run(application(config, server_args({"api_key": API_KEY})), name=APP, route_prefix="/")
    return ray_instance


@pytest.fixture
def http(base):
    with httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def scrape(http: httpx.Client) -> str:
    response = http.get("/metrics")
    assert response.status_code == 200
    return response.text


def replica_pids(deployment: str) -> dict[str, int]:
    return ray.get(routing_hub(APP).replica_pids.remote(deployment))


def test_openai_client_streams_through_the_ingress(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 8 and text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()


def test_responses_api_through_the_ingress(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    response = client.responses.create(
        model="tiny", input="Say something.", instructions="Be brief.", max_output_tokens=6
    )
    assert response.status == "incomplete" and response.usage.output_tokens == 6 and response.output_text
    events = list(client.responses.create(model="tiny-qwen", input="Hi", max_output_tokens=4, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp_1")


def test_multi_model_routing_and_unknown_model(http):
    listed = [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert sorted(listed) == ["embedder", "tiny", "tiny-qv", "tiny-qwen"]
    # The adapter "tiny-qv" is left to its own test: a request here would load it on a replica already.
    for name in ["tiny", "tiny-qwen"]:
        body = http.post("/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 3}).json()
        assert body["model"] == name and body["usage"]["completion_tokens"] == 3
    response = http.post(
        "/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}
    )
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "'tiny'" in error["message"] and "'tiny-qwen'" in error["message"]
    # Several prompts in one request: each its own engine request, routed at once.
    body = http.post("/v1/completions", json={"model": "tiny", "prompt": ["a b", "c d", "e f", "g h"], "max_tokens": 2})
    assert [c["index"] for c in body.json()["choices"]] == [0, 1, 2, 3]
    # A bad request fails alone, with the engine's own message, as on a single server.
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 100_000})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_an_adapter_is_served_by_its_base_models_replicas(http, models, adapter_path):
    """models.yaml's lora_modules: the adapter is a model with its parent, answering as the engine does
    offline; its requests go to the replica that has it loaded, and its prefix blocks are its own (the
    router's matched blocks, keyed by the adapter's digest, are the replica's real hits)."""
    from tachyllm import LLM, SamplingParams
    from tachyllm.lora.request import LoRARequest

    card = http.get("/v1/models/tiny-qv").json()
    assert (card["parent"], card["root"]) == ("tiny", adapter_path)
    llm = LLM(models["tiny"], dtype="float32", kv_cache_memory=4 << 20, max_model_len=512, enable_lora=True,
              max_lora_rank=8)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    lora = LoRARequest("tiny-qv", 1, adapter_path)
    expected = [o.outputs[0].text for o in llm.generate(["Hello there", "Hello there"], params, use_tqdm=False,
                                                          lora_request=[lora, None])]  # fmt: skip
    assert expected[0] != expected[1]
    for name, text in zip(["tiny-qv", "tiny"], expected):
        body = {"model": name, "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        answer = http.post("/v1/completions", json=body).json()
        assert (answer["model"], answer["choices"][0]["text"]) == (name, text)
    time.sleep(0.6)  # the replica's loaded adapter reaches the router (0.1 s intervals)
    before = scrape(http)
    for i in range(6):  # short prompts, no full block: only the loaded adapter tells the replicas apart
        response = http.post("/v1/completions", json={"model": "tiny-qv", "prompt": f"{i} {i}", "max_tokens": 2})
        assert response.status_code == 200
    after = scrape(http)
    by_replica = per_replica(after, "tachy:lora_requests_total", "tiny")
    grown = {r: n - per_replica(before, "tachy:lora_requests_total", "tiny").get(r, 0) for r, n in by_replica.items()}
    assert sorted(grown.values())[-1] == 6, grown
    # A long prompt: the base model's blocks are no hit for the adapter, its own blocks are.
    prompt = SYSTEM.format(i=7)
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).status_code == 200
    for turn in range(2):
        time.sleep(0.6)
        earlier = scrape(http)
        response = http.post("/v1/completions", json={"model": "tiny-qv", "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200
        now = scrape(http)
        matched = 16 * (metric(now, "tachy:router_matched_blocks_total", model_name="tiny")
                        - metric(earlier, "tachy:router_matched_blocks_total", model_name="tiny"))  # fmt: skip
        hits = metric(now, "tachy:prefix_cache_hits_total", model_name="tiny") - metric(
            earlier, "tachy:prefix_cache_hits_total", model_name="tiny"
        )
        assert hits == matched and (hits > 0) == (turn == 1), (turn, hits, matched)


def test_the_other_endpoints(http):
    """Every endpoint of a single server answers through the ingress, for each model."""
    ids = http.post("/tokenize", json={"model": "tiny-qwen", "prompt": "hello there"}).json()["tokens"]
    assert http.post("/detokenize", json={"model": "tiny-qwen", "tokens": ids}).json()["prompt"] == "hello there"
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert http.get("/health").status_code == 200 and http.get("/version").status_code == 200
    assert "/v1/chat/completions" in http.get("/openapi.json").json()["paths"]
    response = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    assert http.get("/tokenizer_info", params={"model": "tiny-qwen"}).json()["model_max_length"] == 512
    # Prompt logprobs come back from a replica in its RequestOutputs: echo with logprobs, vLLM's field.
    body = {"model": "tiny", "prompt": "hello there you", "echo": True, "logprobs": 1, "max_tokens": 0}
    choice = http.post("/v1/completions", json={**body, "prompt_logprobs": 1}).json()["choices"][0]
    assert choice["text"] == "hello there you" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][0] is None and None not in choice["logprobs"]["token_logprobs"][1:]
    assert len(choice["prompt_logprobs"]) == len(choice["logprobs"]["tokens"]) > 1


def test_a_chat_model_and_an_embedder_on_one_endpoint(http, base, models):
    """The RAG pair through the ingress: the embedder's answers equal the offline LLM.embed's, each model
    refuses the other's routes, and /v1/models says which is which."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    texts = ["retrieve this chunk", "and that one"]
    data = client.embeddings.create(model="embedder", input=texts).data
    offline = LLM(models["tiny"], runner="pooling", dtype="float32").embed(texts)
    for got, want in zip(data, offline):
        assert got.embedding == pytest.approx(want.outputs.embedding, abs=1e-5)
    ranked = http.post("/v1/rerank", json={"model": "embedder", "query": "chunk", "documents": texts}).json()
    assert sorted(r["index"] for r in ranked["results"]) == [0, 1]
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.usage.completion_tokens == 2
    cards = {card["id"]: card["task"] for card in http.get("/v1/models").json()["data"]}
    assert cards == {"tiny": "generate", "tiny-qwen": "generate", "tiny-qv": "generate", "embedder": "embed"}
    refused = http.post("/v1/embeddings", json={"model": "tiny", "input": "x"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    refused = http.post("/v1/completions", json={"model": "embedder", "prompt": "x"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    bad = http.post("/v1/embeddings", json={"model": "embedder", "input": [0, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_conversation_turns_land_on_the_replica_holding_them(http):
    """Each later turn of a conversation goes where its earlier turns' blocks are: its whole earlier prompt
    is a prefix-cache hit. Four conversations with distinct prefixes, three turns each: random placement
    would miss about half. The router's matched blocks are real hits: scraped right after each answer,
    the replicas' prefix-cache hits have grown by exactly the tokens the router matched."""
    before = scrape(http)
    expected_hits = 0
    for i in range(4):
        messages = [{"role": "system", "content": SYSTEM.format(i=i)}, {"role": "user", "content": "First question?"}]
        earlier_prompt_tokens = 0
        for turn in range(3):
            if turn:
                time.sleep(0.6)  # the replica's events reach the router (0.1 s intervals)
            earlier = scrape(http)
            response = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 6})
            assert response.status_code == 200
            now = scrape(http)
            matched = 16 * (
                metric(now, "tachy:router_matched_blocks_total", model_name="tiny")
                - metric(earlier, "tachy:router_matched_blocks_total", model_name="tiny")
            )
            hits = metric(now, "tachy:prefix_cache_hits_total", model_name="tiny") - metric(
                earlier, "tachy:prefix_cache_hits_total", model_name="tiny"
            )
            assert hits == matched, (i, turn, hits, matched)
            # At least all but the last full block of the turn before.
            expected_hits += max(0, (earlier_prompt_tokens // 16) * 16 - 16)
            earlier_prompt_tokens = response.json()["usage"]["prompt_tokens"]
            reply = response.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Question {turn + 2}?"}]
    after = scrape(http)
    hits = metric(after, "tachy:prefix_cache_hits_total", model_name="tiny") - metric(
        before, "tachy:prefix_cache_hits_total", model_name="tiny"
    )
    assert hits >= expected_hits, (hits, expected_hits)
    decisions = metric(after, "tachy:router_requests_total", model_name="tiny", decision="prefix_hit") - metric(
        before, "tachy:router_requests_total", model_name="tiny", decision="prefix_hit"
    )
    assert decisions >= 8
    assert metric(after, "tachy:router_index_entries", model_name="tiny") > 0
    # Every replica's metrics reach the one scrape, each with its replica label.
    assert len(per_replica(after, "tachy:prompt_tokens_total", "tiny")) == 2


def test_prefill_owed_to_a_replica_is_settled_at_the_first_token(http):
    """The router counts a routed request's uncached prompt blocks against its replica until the
    request's first token reaches the ingress (ray_serve/pending_prefill.py): once a long stream has
    started, nothing is owed though it is still decoding."""
    body = {"model": "tiny", "prompt": SYSTEM.format(i=77) + " Go on.", "max_tokens": 200, "ignore_eos": True}
    body["stream"] = True
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # the first token
        during = scrape(http)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and len(rest) > 20  # it was still streaming at the scrape
    # The series exists only once the router has recorded a request.
    assert re.search(r'^tachy:router_pending_prefill_blocks\{model_name="tiny"\} 0\.0$', during, re.M), during
    assert metric(scrape(http), "tachy:router_pending_prefill_blocks", model_name="tiny") == 0


def test_load_guard_spreads_a_hot_prefix(http, base):
    """Sixteen long requests sharing one cached prefix: once the holder's queue is 3 longer than the
    other's, requests go to the less loaded replica instead."""
    prompt = SYSTEM.format(i=99) + " Tell a long story."
    warm = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert warm.status_code == 200
    time.sleep(0.6)
    before = scrape(http)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 64, "ignore_eos": True}
            responses = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(16)))
            return [r.status_code for r in responses]

    assert asyncio.run(burst()) == [200] * 16
    after = scrape(http)

    def delta(decision: str) -> float:
        return metric(after, "tachy:router_requests_total", model_name="tiny", decision=decision) - metric(
            before, "tachy:router_requests_total", model_name="tiny", decision=decision
        )

    assert delta("prefix_hit") >= 1 and delta("load_fallback") >= 1
    prompts = per_replica(after, "tachy:prompt_tokens_total", "tiny")
    earlier = per_replica(before, "tachy:prompt_tokens_total", "tiny")
    assert all(prompts[r] > earlier.get(r, 0) for r in prompts), "one replica got the whole burst"


def test_a_killed_replica_fails_over(http, base):
    """SIGKILL one of tiny's replicas once the 4 running requests of each replica stream: the victim's
    requests that had not streamed a token (queued behind its running ones) are retried on the other
    replica; its streams that had started end with an OpenAI-format error event, never a hang; new
    requests succeed; Ray restarts the replica and the hub forgets the dead one."""
    wait_for(lambda: len(replica_pids("engine-tiny")) == 2, 30, "both replicas to report")
    pids = replica_pids("engine-tiny")
    victim, victim_pid = sorted(pids.items())[0]
    before = scrape(http)
    streaming: set[int] = set()  # requests that have received text
    all_running = asyncio.Event()  # both replicas' 4 running requests stream; 8 more wait

    async def one(c: httpx.AsyncClient, i: int) -> str:
        body = {"model": "tiny", "prompt": f"{i} " * 30, "max_tokens": 400, "ignore_eos": True, "stream": True}
        text = ""
        async with c.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"status {response.status_code}"
            async for line in response.aiter_lines():
                text += line + "\n"
                if '"text"' in line:
                    streaming.add(i)
                    if len(streaming) >= 8:
                        all_running.set()
        return text

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=base, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            tasks = [asyncio.create_task(one(c, i)) for i in range(16)]
            await asyncio.wait_for(all_running.wait(), 60)
            os.kill(victim_pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 100)

    results = asyncio.run(run())
    completed = [r for r in results if r.rstrip().endswith("data: [DONE]") and '"error"' not in r]
    failed = [r for r in results if '"error"' in r]
    assert len(completed) + len(failed) == len(results), results
    for r in failed:
        assert '"code":"replica_failed"' in r and r.rstrip().endswith("data: [DONE]")
    retried = metric(scrape(http), "tachy:replica_retries_total", model_name="tiny") - metric(
        before, "tachy:replica_retries_total", model_name="tiny"
    )
    # The victim ran 4 requests (max_num_seqs) and had more waiting: the first fail, the others go again.
    assert failed and retried >= 1
    for _ in range(4):  # new requests go to the survivor (or to the restarted replica)
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": "after", "max_tokens": 2})
        assert response.status_code == 200
    wait_for(lambda: victim not in replica_pids("engine-tiny"), 30, "the hub to drop the dead replica")
    wait_for(lambda: len(replica_pids("engine-tiny")) == 2, 90, "Ray to restart the replica")


def test_autoscaling_up_under_load_and_down_when_idle(ray_instance, models):
    """Deployed the Ray way: the application builder `serve run tachyllm.ray_serve:build_app` calls, with
    its arguments as `serve run` passes them (strings) and the models inline."""
    serve.delete(APP)
    models_arg = [
        {
            "name": "auto",
            "model": models["tiny"],
            "threads_per_replica": 1,
            "num_cpus": 0.5,
            "engine": ENGINE,
            "autoscale": {
                "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
                "downscale_delay_s": 2, "metrics_interval_s": 0.5, "look_back_period_s": 1,
            },
        }
    ]  # fmt: skip
    serve.run(build_app({"models": models_arg, "max_n": "4"}), name="auto", route_prefix="/")

    def running() -> int:
        status = serve.status().applications["auto"].deployments["engine-auto"]
        return status.replica_states.get("RUNNING", 0)

    assert running() == 1

    async def load(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=ray_instance, timeout=120) as c:

            async def worker() -> None:
                body = {"model": "auto", "prompt": "load " * 20, "max_tokens": 200, "ignore_eos": True}
                while not stop.is_set():
                    assert (await c.post("/v1/completions", json=body)).status_code == 200

            await asyncio.gather(*(worker() for _ in range(6)))

    async def until_scaled_up() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(load(stop))
        t0 = time.monotonic()
        try:
            while running() < 2:
                assert time.monotonic() - t0 < 60, "did not scale up under load"
                assert not task.done(), task.exception()
                await asyncio.sleep(0.5)
            return time.monotonic() - t0
        finally:
            stop.set()
            await task

    asyncio.run(until_scaled_up())
    assert running() == 2  # bounded by max_replicas
    wait_for(lambda: running() == 1, 60, "scaling back down when idle")


def test_without_replicas_ray_is_not_imported():
    code = "\n".join(
        [
            "import sys",
            "from tachyllm.entrypoints.cli import build_parser",
            "from tachyllm.entrypoints.serve import uses_ray",
            "print(uses_ray(build_parser().parse_args(['serve'])), 'ray' in sys.modules)",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
