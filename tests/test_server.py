"""The OpenAI-compatible server, end to end: real uvicorn servers on free ports, driven by the
official openai client and by raw HTTP (httpx) for everything a client library would not send."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from helpers.engine import GREEDY
from helpers.server import (
    ENGINE_FLAGS,
    error_of,
    metrics,
    running_server,
    server_process,
    sse_events,
    wait_idle,
)

from tachyllm import LLM, SamplingParams, faults
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser
from tachyllm.errors import ConfigError, RequestError
from tachyllm.server.async_engine import AsyncEngine

API_KEY = "test-key"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def url(model_path) -> Iterator[str]:
    with running_server(model_path) as base:
        yield base


@pytest.fixture(scope="module")
def limited_url(model_path) -> Iterator[str]:
    """One sequence at a time, one waiting request at most, an API key, and two model names."""
    flags = [
        "--max-num-seqs",
        "1",
        "--max-queue-len",
        "1",
        "--api-key",
        API_KEY,
        "--served-model-name",
        "tiny",
        "alias",
    ]
    with running_server(model_path, *flags) as base:
        yield base


@pytest.fixture(scope="module")
def offline(model_path) -> LLM:
    return LLM(model_path, dtype="float32", kv_cache_memory=4 << 20)


@pytest.fixture(scope="module")
def limited_http(limited_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited_url, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


IMAGE_MESSAGE = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}


# -- AsyncEngine --------------------------------------------------------------------------------


def thread_cpu_ticks(native_id: int) -> int:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_async_engine_streams_aborts_and_idles(model_path):
    engine = AsyncEngine(
        lambda: LLMEngine(engine_config(build_parser().parse_args(["serve", "--model", model_path, *ENGINE_FLAGS])))
    )
    params = SamplingParams(max_tokens=200, **GREEDY)

    async def main() -> None:
        texts = [
            out.outputs[0].text
            async for out in engine.generate("whole", "The quick", SamplingParams(max_tokens=5, **GREEDY))
        ]
        assert len(texts) >= 1 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        with pytest.raises(RequestError):
            await engine.add_request("empty", [], params)
        stream = engine.generate("early", "The quick", params)
        await anext(stream)
        await stream.aclose()  # leaving early aborts the request
        for _ in range(200):
            if engine.snapshot.kv_cache_usage == 0 and engine.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.snapshot.kv_cache_usage == 0 and engine.snapshot.stats.finished_reasons.get("abort") == 1

    try:
        asyncio.run(main())
        if os.path.exists("/proc/self/task"):  # an idle engine thread sleeps instead of spinning
            before = thread_cpu_ticks(engine._thread.native_id)
            time.sleep(0.5)
            assert thread_cpu_ticks(engine._thread.native_id) - before <= 2
    finally:
        engine.shutdown()
    assert not engine._thread.is_alive()


def test_async_engine_builds_its_engine_on_the_loop_thread(model_path):
    """All of the engine's compute, loading included, runs on one thread (one OpenMP thread pool:
    see async_engine.py); a build that fails raises from the constructor."""
    built_on = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread())
        return LLMEngine(engine_config(build_parser().parse_args(["serve", "--model", model_path, *ENGINE_FLAGS])))

    engine = AsyncEngine(build)
    try:
        assert built_on == [engine._thread] and engine.model_name == model_path
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError, match="block_size must be >= 1"):
        AsyncEngine(
            lambda: LLMEngine(
                engine_config(build_parser().parse_args(["serve", "--model", model_path, "--block-size", "0"]))
            )
        )


# -- the openai client -------------------------------------------------------------------------


def test_completion_matches_offline(client, offline, model_path):
    out = client.completions.create(model=model_path, prompt="The quick brown", max_tokens=12, extra_body=GREEDY)
    ref = offline.generate("The quick brown", SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    assert out.object == "text_completion" and out.model == model_path
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_chat_matches_offline_and_streams(client, offline, model_path):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a fox."}]},
        {"role": "assistant", "content": "Quick."},
        {"role": "user", "content": "Another?"},
    ]
    ref_messages = [
        {**m, "content": m["content"][0]["text"]} if isinstance(m["content"], list) else m for m in messages
    ]
    ref = offline.chat(ref_messages, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0]
    out = client.chat.completions.create(
        model=model_path, messages=messages, max_completion_tokens=10, extra_body=GREEDY
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)

    chunks = list(
        client.chat.completions.create(
            model=model_path,
            messages=messages,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_stream_sends_nothing_before_the_first_token(http, model_path):
    """The role goes out with the first content (vLLM's timing), so a client's TTFT from the first SSE
    event includes the prefill: here a prefill held up 0.8 s by a hook in the engine's forward."""
    delay, delayed = 0.8, set()

    def slow_prefill(stage: str, request_ids: list[str]) -> None:
        if stage == "forward" and any(r.startswith("chatcmpl-") and r not in delayed for r in request_ids):
            delayed.update(request_ids)
            time.sleep(delay)

    body = {"model": model_path, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with faults.injected(slow_prefill):
        start = time.perf_counter()
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            first_event = time.perf_counter() - start
            rest = [line for line in lines if line.startswith("data: ")]
    assert delayed and first_event >= delay, first_event
    chunk = json.loads(first.removeprefix("data: "))
    assert chunk["choices"][0]["delta"]["role"] == "assistant" and chunk["choices"][0]["delta"]["content"]
    roles = [json.loads(line.removeprefix("data: "))["choices"][0]["delta"]["role"] for line in rest[:-1]]
    # The role once per choice (a busy machine may have merged every token into the first chunk).
    assert set(roles) <= {None}


def test_streamed_completion_equals_whole(client, model_path):
    whole = client.completions.create(
        model=model_path, prompt="def add(a, b):", max_tokens=20, stop=["\n\n"], extra_body=GREEDY
    )
    stream = client.completions.create(
        model=model_path,
        prompt="def add(a, b):",
        max_tokens=20,
        stop=["\n\n"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_32_concurrent_streams_match_offline(url, offline, model_path):
    words = "fox dog blocks cache tokens paged école 東京 numbers 42 attention batch".split()
    prompts = [f"{words[i % len(words)]} {words[(i * 5) % len(words)]} {i}" for i in range(32)]
    refs = offline.generate(prompts, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(
            model=model_path, prompt=prompt, max_tokens=16, stream=True, extra_body=GREEDY
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == [r.outputs[0].text for r in refs]


def test_async_chat_and_n(url, model_path):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as aclient:
            return await aclient.chat.completions.create(
                model=model_path,
                messages=[{"role": "user", "content": "hi"}],
                n=3,
                seed=7,
                temperature=1.0,
                max_tokens=6,
            )

    out = asyncio.run(main())
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert 3 <= out.usage.completion_tokens <= 18
    again = asyncio.run(main())  # per-request seeds make sampling reproducible
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_prompt_forms_echo_and_logprobs(client, offline, model_path):
    tok = offline.get_tokenizer()
    out = client.completions.create(
        model=model_path, prompt=["The quick", "Paged"], n=2, max_tokens=4, echo=True, extra_body=GREEDY
    )
    by_index = {c.index: c.text for c in out.choices}
    assert sorted(by_index) == [0, 1, 2, 3]  # prompt i, sample j -> index i * n + j
    assert by_index[0].startswith("The quick") and by_index[0] == by_index[1]
    assert by_index[2].startswith("Paged") and by_index[2] == by_index[3]
    assert out.usage.prompt_tokens == len(tok.encode("The quick")) + len(tok.encode("Paged"))

    ids = tok.encode("Paged attention")
    out = client.completions.create(model=model_path, prompt=ids, max_tokens=3, echo=True, extra_body=GREEDY)
    assert out.choices[0].text.startswith(tok.decode(ids, skip_special_tokens=False))
    out = client.completions.create(model=model_path, prompt=[ids, ids], max_tokens=5, logprobs=3, extra_body=GREEDY)
    assert out.choices[0].text == out.choices[1].text
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # Token strings are decoded one by one, so a character split across tokens shows as U+FFFD.
    assert out.choices[0].text.startswith("".join(lp.tokens).split("\ufffd")[0])
    assert lp.text_offset[0] == 0 and all(len(t) <= 3 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one (top_logprobs may merge tokens that print alike).
    assert all(v >= max(t.values()) - 1e-5 for t, v in zip(lp.top_logprobs, lp.token_logprobs))

    chat = client.chat.completions.create(
        model=model_path,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body=GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_default_max_tokens_fills_the_context(client, offline, model_path):
    out = client.completions.create(model=model_path, prompt="The quick brown", extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == offline.engine.max_model_len


def test_stop_reasons_and_vllm_extensions(client, offline, model_path):
    full = offline.generate("abc", SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[3]
    out = client.completions.create(
        model=model_path, prompt="abc", max_tokens=10, extra_body={**GREEDY, "stop_token_ids": [stop_id]}
    )
    assert out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model=model_path,
        prompt="abc",
        max_tokens=10,
        extra_body={**GREEDY, "min_tokens": 10, "stop_token_ids": [stop_id], "top_k": 0},
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 10


def test_token_restrictions_and_prompt_truncation_as_request_fields(client, offline, model_path):
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens, as the offline SamplingParams."""
    for fields in ({"allowed_token_ids": [5, 6, 7]}, {"bad_words": ["hello", "x"]}, {"truncate_prompt_tokens": 2}):
        served = client.completions.create(
            model=model_path, prompt="abc def ghi", max_tokens=6, extra_body={**GREEDY, **fields}
        )
        alone = offline.generate("abc def ghi", SamplingParams(max_tokens=6, **GREEDY, **fields), use_tqdm=False)[0]
        assert served.choices[0].text == alone.outputs[0].text
        assert served.usage.prompt_tokens == len(alone.prompt_token_ids)
        if "allowed_token_ids" in fields:
            assert set(alone.outputs[0].token_ids) <= {5, 6, 7}
    assert served.usage.prompt_tokens == 2
    # A conversation longer than the context runs when truncated.
    long_text = "abc " * offline.engine.max_model_len
    chat = client.chat.completions.create(
        model=model_path,
        messages=[{"role": "user", "content": long_text}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 100},
    )
    assert chat.usage.prompt_tokens == 100 and chat.usage.completion_tokens == 2


# -- auxiliary endpoints -----------------------------------------------------------------------


def test_models_health_version_tokenize(client, http, model_path, offline):
    assert [m.id for m in client.models.list().data] == [model_path]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    tok = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert tok["tokens"] == offline.get_tokenizer().encode("hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 512 and len(tok["token_strs"]) == tok["count"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hello world"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == offline.get_tokenizer().encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_metrics_move_after_a_request(client, http, offline, model_path):
    num_prompt_tokens = len(offline.get_tokenizer().encode("The quick brown"))
    before = wait_idle(http)
    client.completions.create(model=model_path, prompt="The quick brown", max_tokens=7, extra_body=GREEDY)
    after = wait_idle(http)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("tachy:prompt_tokens_total") == num_prompt_tokens
    assert delta("tachy:generation_tokens_total") == 7
    assert delta("tachy:request_success_total", finished_reason="length") == 1
    assert delta("tachy:prefix_cache_queries_total") == num_prompt_tokens
    assert delta("tachy:time_to_first_token_seconds_count") == 1
    assert delta("tachy:inter_token_latency_seconds_count") == 6  # one per token after the first
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "request_time_per_output_token"):  # fmt: skip
        assert delta(f"tachy:{name}_seconds_count") == 1
    assert delta("tachy:e2e_request_latency_seconds_sum") > 0
    assert ("tachy:num_preemptions_total", ()) in after


def test_request_log_line(client, model_path, caplog):
    caplog.set_level(logging.INFO, logger="tachyllm.server")
    out = client.completions.create(model=model_path, prompt="The quick", max_tokens=3, extra_body=GREEDY)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"request {out.id}-0 finished")]
    assert len(lines) == 1 and "length, prompt 2 tokens, output 3 tokens, ttft" in lines[0] and "tpot" in lines[0]


def test_client_disconnect_aborts_and_frees_kv(http):
    before = wait_idle(http)
    body = {"prompt": "The quick brown fox", "max_tokens": 480, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    # The connection is closed here, mid-generation.
    after = wait_idle(http)
    assert after[("tachy:kv_cache_usage_perc", ())] == 0
    aborted = ("tachy:request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) - before.get(aborted, 0) == 1
    assert after[("tachy:generation_tokens_total", ())] - before[("tachy:generation_tokens_total", ())] < 480


def test_non_streaming_disconnect_aborts(http, url):
    before = wait_idle(http)
    body = json.dumps({"prompt": "abc", "max_tokens": 480, **GREEDY}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 5
        while metrics(http)[("tachy:num_requests_running", ())] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    # Hung up mid-generation, before any response byte.
    after = wait_idle(http)
    aborted = ("tachy:request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) - before.get(aborted, 0) == 1
    assert after[("tachy:kv_cache_usage_perc", ())] == 0


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0), ("presence_penalty", 2.5),
        ("frequency_penalty", -3), ("logprobs", 21), ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0),
        ("min_tokens", -1), ("seed", -1), ("stop_token_ids", [-1]), ("min_tokens", 20), ("allowed_token_ids", []),
        ("allowed_token_ids", [10**6]), ("bad_words", [""]), ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
    ],
)  # fmt: skip
def test_out_of_range_completion_fields(http, field, value):
    error = error_of(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10, field: value}), 400)
    assert error["param"].startswith(field) and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("top_logprobs", 21), ("max_completion_tokens", 0), ("top_p", -1)])
def test_out_of_range_chat_fields(http, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, field: value}
    assert error_of(http.post("/v1/chat/completions", json=body), 400)["param"] == field


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"max_tokens": 5}, "prompt"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [IMAGE_MESSAGE]}, "messages[0].content[0]"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ],
)  # fmt: skip
def test_wrong_types(http, path, body, param):
    assert error_of(http.post(path, json=body), 400)["param"] == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": "hi", "logit_bias": {"999999": 1.0}}, "logit_bias"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [10**6]}, "prompt"),
    ],
)
def test_unsupported_or_empty(http, body, param):
    assert error_of(http.post("/v1/completions", json=body), 400)["param"] == param


def test_malformed_json_and_non_object(http):
    for raw in (b"{bad", b"", b"[1, 2]", b'"text"'):
        error = error_of(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
        assert error["param"] is None


def test_over_long_prompts(http):
    long_prompt = "fox " * 600
    error = error_of(http.post("/v1/completions", json={"prompt": long_prompt}), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    error = error_of(http.post("/v1/completions", json={"prompt": "fox " * 100, "max_tokens": 500}), 400)
    assert error["param"] == "max_tokens" and "512" in error["message"]
    body = {"messages": [{"role": "user", "content": long_prompt}]}
    assert error_of(http.post("/v1/chat/completions", json=body), 400)["param"] == "messages"


def test_unknown_model_and_route(http):
    error = error_of(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    error_of(http.get("/v1/nothing"), 404)


def test_bad_input_does_not_disturb_a_running_stream(http, offline):
    ref = offline.generate("The quick", SamplingParams(max_tokens=200, **GREEDY), use_tqdm=False)[0].outputs[0].text
    with http.stream(
        "POST", "/v1/completions", json={"prompt": "The quick", "max_tokens": 200, "stream": True, **GREEDY}
    ) as r:
        events = sse_events(r)
        text = next(events)["choices"][0]["text"]
        for raw in (b"{bad", b'{"prompt": 1}', b'{"prompt": "x", "max_tokens": 9999}'):
            response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert response.status_code == 400
        text += "".join(e["choices"][0]["text"] for e in events if e != "[DONE]")
    assert text == ref


def test_auth(limited_url, limited_http):
    with httpx.Client(base_url=limited_url, timeout=10) as anonymous:
        assert error_of(anonymous.get("/v1/models"), 401)["type"] == "authentication_error"
        error_of(anonymous.post("/v1/completions", json={"prompt": "hi"}), 401)
        error_of(anonymous.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        error_of(anonymous.post("/tokenize", json={"prompt": "hi"}), 401)
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
    assert limited_http.get("/v1/models").status_code == 200
    client = openai.OpenAI(base_url=f"{limited_url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{limited_url}/v1", api_key="nope", max_retries=0).models.list()


def test_the_security_doc_lists_the_routes_the_key_protects(limited_url):
    section = (Path(__file__).parent.parent / "docs/security.md").read_text()
    section = section.split("## What the API key protects", 1)[1].split("\n## ", 1)[0]
    prose, _, table = section.partition("| route |")
    documented_protected = set(re.findall(r"`(/[^`]*)`", prose))
    documented_open = set(re.findall(r"^\| `(/[^`]*)`", table, re.MULTILINE))
    with httpx.Client(base_url=limited_url, timeout=10) as anonymous:
        paths = anonymous.get("/openapi.json").json()["paths"]
        assert documented_protected | documented_open == {*paths, "/openapi.json"}
        for path, operations in paths.items():
            for method in operations:
                response = anonymous.request(method, path.replace("{model_id}", "tiny"), json={})
                assert (response.status_code == 401) == (path in documented_protected), (method, path)


def test_served_model_names(limited_http, model_path):
    assert [m["id"] for m in limited_http.get("/v1/models").json()["data"]] == ["tiny", "alias"]
    out = limited_http.post("/v1/completions", json={"model": "alias", "prompt": "hi", "max_tokens": 2}).json()
    assert out["model"] == "tiny"
    body = {"model": model_path, "prompt": "hi"}  # the path is not a served name any more
    assert error_of(limited_http.post("/v1/completions", json=body), 404)["param"] == "model"


def test_full_queue_is_503_with_retry_after(limited_http):
    body = {"prompt": "The quick brown fox", "max_tokens": 480, "stream": True, **GREEDY}
    with limited_http.stream("POST", "/v1/completions", json=body) as running:
        assert running.status_code == 200
        events = sse_events(running)  # kept: dropping a half-read iterator closes the connection
        next(events)  # running: the one sequence slot is taken
        with limited_http.stream("POST", "/v1/completions", json=body) as waiting:
            assert waiting.status_code == 200  # admitted: it waits in the engine's queue
            response = limited_http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            error = error_of(response, 503)
            assert error["code"] == "queue_full" and int(response.headers["Retry-After"]) >= 1
    # Both streams were closed early: their requests are aborted and the queue is free again.
    wait_idle(limited_http)
    assert limited_http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


# -- shutdown ----------------------------------------------------------------------------------


@pytest.mark.slow  # waits out its 8-second shutdown timeout by design
def test_sigterm_drains_then_exits_zero(tiny_model_factory):
    # A request that is running at SIGTERM finishes within the shutdown timeout; queued ones that cannot are aborted.
    # Sized so that neither depends on the machine's speed: the running request is short (300 tokens in 8 s), the
    # queued ones could not finish in time on any CPU (30,000 tokens each, one sequence slot).
    model = str(tiny_model_factory("llama", max_position_embeddings=32768))
    flags = ["--max-num-seqs", "1", "--shutdown-timeout", "8", "--dtype", "float32", "--kv-cache-memory", "64M"]
    with server_process(model, *flags, "--log-stats-interval", "0.2") as (proc, base):
        first_token, queued = threading.Event(), threading.Semaphore(0)

        def stream(max_tokens: int) -> list:
            body = {"prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True, **GREEDY}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                queued.release()
                events = []
                for event in sse_events(r):
                    events.append(event)
                    first_token.set()
                return events

        with ThreadPoolExecutor(10) as pool:
            running = pool.submit(stream, 300)
            assert first_token.wait(timeout=30) and queued.acquire(timeout=30)
            waiting = [pool.submit(stream, 30_000) for _ in range(9)]
            for _ in waiting:
                assert queued.acquire(timeout=30)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while httpx.get(f"{base}/health", timeout=5).status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, timeout=5)
            assert error_of(refused, 503)["code"] == "shutting_down" and "Retry-After" in refused.headers
            results = [f.result(timeout=60) for f in [running, *waiting]]
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read()  # a few dozen lines: well under a pipe's buffer

    finished = [r for r in results if "choices" in r[-2] and r[-2]["choices"][0]["finish_reason"] == "length"]
    aborted = [r for r in results if "error" in r[-2]]
    assert len(finished) + len(aborted) == 10 and all(r[-1] == "[DONE]" for r in results)
    assert results[0] in finished, "the running request should have finished within the shutdown timeout"
    assert len(aborted) == 9 and all(r[-2]["error"]["code"] == "aborted" for r in aborted)
    assert "shutting down: waiting up to 8.0 s for 10 requests" in log
    assert f"shutdown timeout reached: aborting {len(aborted)} unfinished requests" in log
    assert "running 1, waiting" in log and "prefix cache hit rate" in log
    assert log.count("finished: length, prompt") == len(finished) and log.count("finished: abort") == len(aborted)


def test_speculative_decoding_metrics_and_bad_config(model_path):
    spec = '{"method": "draft_model", "model": "self:layers=1", "num_speculative_tokens": 3, "adaptive": false}'
    with running_server(model_path, "--speculative-config", spec) as base, httpx.Client(base_url=base) as http:
        body = {"model": model_path, "prompt": "def add(a, b):", "max_tokens": 12, **GREEDY}
        assert http.post("/v1/completions", json=body).status_code == 200
        m = wait_idle(http)
        drafts = m[("tachy:spec_decode_num_drafts_total", ())]
        draft_tokens = m[("tachy:spec_decode_num_draft_tokens_total", ())]
        accepted = m[("tachy:spec_decode_num_accepted_tokens_total", ())]
        assert drafts > 0 and drafts <= draft_tokens <= 3 * drafts
        per_pos = sum(v for (name, _), v in m.items() if name == "tachy:spec_decode_num_accepted_tokens_per_pos_total")
        assert per_pos == accepted
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "eagle"}'])
    with pytest.raises(ConfigError, match="needs 'method' and 'num_speculative_tokens'"):
        engine_config(args)
