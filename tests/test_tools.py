"""Tool calling: the generic JSON format (templates without tools, the default model's) and the Hermes
<tool_call> format (templates that write it), tool_choice auto / required / named, streaming, tool
results in the history, and every bad tool input as a 400."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest
from test_server import error_of, running_server

from tachyllm.server.tools import GENERIC, HERMES, ToolCallStream, ToolPlan, render_history

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
    assert stream.finish(True) == ("", [])
    stream = ToolCallStream(plan(GENERIC))
    assert stream.feed(' {"tool') == "" and stream.feed('_calls": [{"name": "get_time", ') == ""
    rest, calls = stream.finish(True) if stream.feed('"arguments": {"zone": "UTC"}}]}') == "" else (None, None)
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    stream = ToolCallStream(plan(GENERIC))
    assert stream.feed("{") == "" and stream.feed('"a": 1}') == '{"a": 1}'  # an object, not a call
    stream = ToolCallStream(plan(HERMES))
    assert stream.feed("Checking <tool") == "Checking " and stream.feed("_call>{") == ""
    stream.feed('"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    assert [c.name for c in stream.finish(True)[1]] == ["get_time"]
    stream = ToolCallStream(plan(HERMES))
    assert stream.feed("a <to") == "a " and stream.feed("day") == "<today"
    # Cut by max_tokens: whatever was held is content.
    stream = ToolCallStream(plan(GENERIC))
    stream.feed('{"tool_calls": [{"name": "get_')
    assert stream.finish(False) == ('{"tool_calls": [{"name": "get_', [])


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
            compiler.compile(ToolPlan(fmt, [with_refs, TIME], choice, named, parallel).constraint())
    assert ToolPlan(fmt, [with_refs], "auto", None, True).constraint() is None


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
    # With parallel calls allowed, the grammar takes more than one.
    several = ask(client, tool_choice="required", max_tokens=200).choices[0]
    assert several.finish_reason == "length" and several.message.content.count('"name": ') > 1


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
