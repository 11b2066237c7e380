"""The input processor: each refusal (with the message and field it names), the engine queueing a processed
request without checking it again, and one conversation giving the same token ids through LLM.chat, the CLI,
the server and `tachy bench serve`'s client-side count."""

from __future__ import annotations

import builtins

import httpx
import pytest
from helpers.server import serving

from tachyllm import LLM, SamplingParams
from tachyllm.bench.serve import prompt_length
from tachyllm.engine.input_processor import InputLimits, InputProcessor, ProcessedRequest, chat_prompt_ids
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.entrypoints import cli
from tachyllm.entrypoints.serve import make_server
from tachyllm.errors import RequestError
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine

CONVERSATION = [{"role": "user", "content": "hi there"}]
VOCAB = 400  # the tiny model's


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(model_path, dtype="float32", kv_cache_memory=4 << 20)


def processor(llm: LLM, **limits) -> InputProcessor:
    defaults = dict(
        vocab_size=VOCAB, max_model_len=64, num_kv_blocks=8, block_size=16, max_num_batched_tokens=32,
        enable_chunked_prefill=False,
    )  # fmt: skip
    return InputProcessor(llm.get_tokenizer(), InputLimits(**{**defaults, **limits}))


@pytest.mark.parametrize(
    "prompt, params, message, param",
    [
        ("", {}, "prompt is empty", None),
        ([], {}, "prompt is empty (no tokens)", "prompt"),
        ([5, VOCAB, -1], {}, f"prompt token ids must be in [0, {VOCAB}), got [{VOCAB}, -1]", "prompt"),
        ([5, "6"], {}, f"prompt token ids must be in [0, {VOCAB}), got ['6']", "prompt"),
        (
            [5], {"stop_token_ids": [VOCAB]},
            f"stop_token_ids: token id {VOCAB} is not in the vocabulary (ids 0 to {VOCAB - 1})", "stop_token_ids",
        ),
        (
            [5], {"logit_bias": {VOCAB + 1: 1.0}},
            f"logit_bias: token id {VOCAB + 1} is not in the vocabulary (ids 0 to {VOCAB - 1})", "logit_bias",
        ),
        ([5] * 10, {"max_tokens": 60}, "prompt (10 tokens) + max_tokens (60) = 70 exceeds max_model_len (64)", None),
        (
            [5] * 30, {"max_tokens": 1},
            "prompt (30 tokens) exceeds max_num_batched_tokens (20) and chunked prefill is disabled", None,
        ),
    ],
)  # fmt: skip
def test_each_refusal(llm, prompt, params, message, param):
    with pytest.raises(RequestError) as refused:
        processor(llm, max_num_batched_tokens=20).process(prompt, SamplingParams(**params))
    assert str(refused.value) == message and refused.value.param == param


def test_kv_cache_refusal_and_what_fits(llm):
    small = processor(llm, num_kv_blocks=2, max_num_batched_tokens=64)
    with pytest.raises(RequestError) as refused:
        small.process([5] * 30, SamplingParams(max_tokens=5))
    assert str(refused.value) == (
        "prompt + max_tokens = 35 tokens needs 3 KV blocks but the cache has only 2; "
        "raise kv_cache_memory or lower max_tokens"
    )
    assert small.limits.context_limit == 32
    params = SamplingParams(max_tokens=2)
    assert small.process([5] * 30, params) == ProcessedRequest(None, [5] * 30, params)
    # Chunked prefill lifts the per-step limit on the prompt.
    assert processor(llm, enable_chunked_prefill=True).process([5] * 40, params).prompt_token_ids == [5] * 40
    text = small.process("hello world", params)
    assert text.prompt == "hello world" and text.prompt_token_ids == llm.get_tokenizer().encode("hello world")


def test_engine_checks_direct_requests_and_queues_processed_ones_as_they_are(llm, monkeypatch):
    engine = llm.engine
    with pytest.raises(RequestError, match="max_model_len"):
        engine.add_request("too-long", [5] * 600, SamplingParams(max_tokens=8))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    processed = engine.input_processor.process("The quick", params)
    with pytest.raises(ValueError, match="its own sampling params"):
        engine.add_request("other-params", processed, SamplingParams(max_tokens=3))

    def checked_again(*args):
        raise AssertionError("a processed request was checked again")

    monkeypatch.setattr(engine.input_processor, "process", checked_again)
    engine.add_request("processed", processed)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].prompt == "The quick" and len(outs[-1].outputs[0].token_ids) == 3
    assert outs[-1].prompt_token_ids == llm.get_tokenizer().encode("The quick")


def test_one_conversation_gives_the_same_token_ids_everywhere(llm, model_path, monkeypatch):
    expected = chat_prompt_ids(llm.get_tokenizer(), CONVERSATION)
    assert expected == llm.engine.input_processor.chat_prompt_ids(CONVERSATION)
    assert llm.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids == expected
    assert prompt_length(llm.get_tokenizer(), CONVERSATION) == len(expected)

    # The CLI: `tachy generate --chat` and one turn of `tachy chat`.
    sent = []

    def fake_stream(engine, request_id, prompt, params):
        sent.append(prompt)
        yield ""

    lines = iter(["hi there"])

    def fake_input(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(cli, "stream", fake_stream)
    monkeypatch.setattr(cli, "LLMEngine", lambda config: llm.engine)
    monkeypatch.setattr(builtins, "input", fake_input)
    assert cli.main(["generate", "--model", model_path, "--chat", "hi there"]) == 0
    assert cli.main(["chat", "--model", model_path]) == 0
    assert sent == [expected, expected]

    # The server: /tokenize shows them, and a chat completion runs on them, each checked once.
    args = cli.build_parser().parse_args(
        ["serve", "--model", model_path, "--port", "0", "--dtype", "float32", "--kv-cache-memory", "4M"]
    )
    engine = AsyncEngine(lambda: LLMEngine(cli.engine_config(args)))
    seen = []
    engine.add_output_listener(lambda outs: seen.extend(o.prompt_token_ids for o in outs if o.finished))
    counts = {"process_prompt": 0, "process_request": 0}
    for name in counts:
        method = getattr(engine.input_processor, name)

        def counted(*args, method=method, name=name):
            counts[name] += 1
            return method(*args)

        monkeypatch.setattr(engine.input_processor, name, counted)
    with serving(make_server(build_app(engine, args), args)) as base, httpx.Client(base_url=base, timeout=30) as http:
        assert http.post("/tokenize", json={"messages": CONVERSATION}).json()["tokens"] == expected
        out = http.post("/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 2}).json()
        assert out["usage"]["prompt_tokens"] == len(expected)
    assert seen == [expected]
    assert counts == {"process_prompt": 1, "process_request": 1}
