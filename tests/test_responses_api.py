"""POST /v1/responses: OpenAI's Responses API over the chat template, stateless; driven by the official
openai client (client.responses.create), whole and streamed: messages, the fields SDKs send, output_text
logprobs, and function tools (function_call items out, function_call_output items back in)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import jsonschema
import openai
import pytest
from helpers.server import tool_room_url as url  # noqa: F401  (a fixture)

from tachyllm import faults
from tachyllm.engine.input_processor import Prompt
from tachyllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tachyllm.server import protocol as p
from tachyllm.server.routes.responses import response_events
from tachyllm.server.tools import HERMES, ToolPlan

GREEDY = {"temperature": 0}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
ASK = "What is the weather in Paris?"
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def as_chat(client, messages: list[dict], max_tokens: int) -> tuple[str, str, int]:
    """(text, finish reason, prompt tokens) of the same conversation as a greedy chat completion."""
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, **GREEDY)
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.prompt_tokens


def test_text_input_with_instructions(client):
    response = client.responses.create(
        model="m", input="The quick brown", instructions="Answer briefly.", max_output_tokens=6, **GREEDY
    )
    text, reason, prompt_tokens = as_chat(
        client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "The quick brown"}], 6
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "m"
    assert response.output_text == text and reason == "length"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert [part.type for part in message.content] == ["output_text"]
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (prompt_tokens, 6)
    assert usage.total_tokens == prompt_tokens + 6
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 6


def test_messages_input_and_a_completed_answer(client):
    messages = [
        {"role": "developer", "content": "Be terse."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Paged"}, {"type": "input_text", "text": "attention"}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "stores blocks", "annotations": []}]},
        {"type": "message", "role": "user", "content": "And then?"},
    ]
    # The end-of-sequence token, forced at the third token, completes the answer.
    response = client.responses.create(model="m", input=messages, max_output_tokens=8, **GREEDY)
    text, _, prompt_tokens = as_chat(
        client,
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Paged\nattention"},
            {"role": "assistant", "content": "stores blocks"},
            {"role": "user", "content": "And then?"},
        ],
        8,
    )
    assert response.output_text == text and response.usage.input_tokens == prompt_tokens


def test_store_is_accepted_and_nothing_is_stored(client):
    response = client.responses.create(model="m", input="hi", max_output_tokens=2, store=True, metadata={"k": "v"})
    assert response.store is False and response.metadata == {"k": "v"}


def test_streamed_events(client):
    whole = client.responses.create(model="m", input="The quick brown", max_output_tokens=12, **GREEDY)
    events = list(
        client.responses.create(model="m", input="The quick brown", max_output_tokens=12, stream=True, **GREEDY)
    )
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == EVENTS[:4] + ["response.output_text.delta"] * deltas + EVENTS[5:] + ["response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-4].text == text and events[-3].part.text == text
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    assert final.output_text == text and final.usage.output_tokens == 12
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")} | {events[2].item.id, events[-2].item.id}
    assert item_ids == {final.output[0].id}


def test_streamed_completion_says_completed(client):
    # The grammar ends the answer well before max_output_tokens: status completed.
    fmt = {"type": "json_schema", "name": "flag", "schema": {"type": "boolean"}}
    events = list(
        client.responses.create(
            model="m", input="hi", max_output_tokens=40, stream=True, text={"format": fmt}, **GREEDY
        )
    )
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
    assert events[-1].response.output[0].status == "completed" and events[-1].response.incomplete_details is None
    assert json.loads(events[-1].response.output_text) in (True, False)


def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    response = client.responses.create(model="m", input="A person:", max_output_tokens=60, text={"format": fmt})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "hi", "foo": 1}, "foo", "unknown field 'foo'"),
        ({"input": "hi", "text": {"format": {"type": "text"}, "bar": 1}}, "text.bar", "unknown field"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name", "needs a name"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "pattern"),
        ({"input": "hi", "tools": [WEATHER, WEATHER]}, "tools", "unique"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
         "tool_choice", "not among the tools"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type",
         "file_search"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
         "text.format", "cannot be combined"),
        ({"input": "hi", "background": True}, "background", "background responses are not supported"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]", "'file_search_call.results'"),
        ({"input": "hi", "top_logprobs": 21}, "top_logprobs", "less than or equal"),
        ({"input": "hi", "reasoning": {"effort": "low", "budget": 3}}, "reasoning.budget", "unknown field"),
        ({"input": "hi", "stream_options": {"include_usage": True}}, "stream_options.include_usage", "unknown field"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].summary", "unknown field"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type", "not supported"),
        ({"input": [{"type": "item_reference", "id": "fc_1"}]}, "input[0].type", "nothing is stored"),
        ({"input": [{"type": "function_call", "name": "get_weather", "arguments": "{}"}]}, "input[0].call_id",
         "needs call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", "needs output"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "role": "user"}]},
         "input[0].role", "not a field of a function_call_output item"),
        ({"input": [{"role": "user"}]}, "input[0].content", "needs content"),
        ({"input": [{"type": "function_call_output", "call_id": "c",
                     "output": [{"type": "input_image", "image_url": "http://x"}]}]},
         "input[0].output[0]", "only text"),
        ({"input": "hi", "temperature": "hot"}, "temperature", "valid number"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater than"),
        ({"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens", "context limit"),
        ({"input": []}, "input", "at least 1 item"),
        ({"input": 5}, "input", "a string or a list of messages"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
         "input[0].content[0]", "only text"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
         "text.format", "text.format"),
        ({"input": "hi", "reasoning_effort": "low"}, "reasoning_effort", "not supported"),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ],
)  # fmt: skip
def test_bad_inputs(http, body, param, words):
    response = http.post("/v1/responses", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_bad_input_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="hi", previous_response_id="resp_123")
    assert caught.value.body["param"] == "previous_response_id"


def test_a_failure_midway_ends_the_stream_with_response_failed(client):
    steps = []

    def fail_third_step(stage: str, request_ids: list[str]) -> None:
        if stage == "detokenize" and any(r.startswith("resp_") for r in request_ids):
            steps.append(stage)
            if len(steps) == 3:
                raise RuntimeError("injected fault")

    with faults.injected(fail_third_step):
        events = list(client.responses.create(model="m", input="hi", max_output_tokens=20, stream=True, **GREEDY))
    assert [e.type for e in events[:4]] == EVENTS[:4]
    assert events[-1].type == "response.failed" and "injected fault" in events[-1].response.error.message
    assert events[-1].response.status == "failed"


def test_openapi_documents_the_route(http):
    doc = http.get("/openapi.json").json()
    assert "/v1/responses" in doc["paths"] and "ResponsesRequest" in doc["components"]["schemas"]


# -- the fields SDKs send -------------------------------------------------------------------------------


def test_fields_sdks_send_are_accepted(client):
    """openai-agents sends include: [] on every request; the others are OpenAI's, each with its meaning here."""
    plain = client.responses.create(model="m", input="The quick brown", max_output_tokens=6, **GREEDY)
    fields = {
        "include": [],
        "reasoning": {"effort": "low", "summary": None},
        "prompt_cache_key": "conversation-7",
        "safety_identifier": "user-42",
        "background": False,
    }
    response = client.responses.create(model="m", input="The quick brown", max_output_tokens=6, **fields, **GREEDY)
    assert response.output_text == plain.output_text and response.usage.input_tokens == plain.usage.input_tokens
    assert (response.prompt_cache_key, response.safety_identifier, response.background) == (
        "conversation-7",
        "user-42",
        False,
    )
    assert response.output[0].content[0].logprobs == []  # not asked for
    events = list(
        client.responses.create(
            model="m",
            input="The quick brown",
            max_output_tokens=6,
            stream=True,
            stream_options={"include_obfuscation": False},
            **fields,
            **GREEDY,
        )
    )
    assert events[-1].response.output_text == plain.output_text


def test_output_text_logprobs(client):
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "The quick brown"}], max_tokens=6,
        logprobs=True, top_logprobs=3, **GREEDY,
    )  # fmt: skip
    expected = chat.choices[0].logprobs.content

    def same(logprobs) -> None:
        assert [(t.token, [a.token for a in t.top_logprobs]) for t in logprobs] == [
            (t.token, [a.token for a in t.top_logprobs]) for t in expected
        ]
        assert [t.logprob for t in logprobs] == pytest.approx([t.logprob for t in expected])

    for ask in ({"include": ["message.output_text.logprobs"], "top_logprobs": 3}, {"top_logprobs": 3}):
        response = client.responses.create(model="m", input="The quick brown", max_output_tokens=6, **ask, **GREEDY)
        same(response.output[0].content[0].logprobs)
        assert response.top_logprobs == 3
        events = list(
            client.responses.create(
                model="m", input="The quick brown", max_output_tokens=6, stream=True, **ask, **GREEDY
            )
        )
        streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
        assert [t.token for t in streamed] == [t.token for t in expected]
        assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in expected])
        same(events[-1].response.output[0].content[0].logprobs)
    # Without top_logprobs, each token's own logprob and no alternatives.
    response = client.responses.create(
        model="m", input="The quick brown", max_output_tokens=6, include=["message.output_text.logprobs"], **GREEDY
    )
    logprobs = response.output[0].content[0].logprobs
    assert [t.logprob for t in logprobs] == pytest.approx([t.logprob for t in expected])
    assert all(t.top_logprobs == [] for t in logprobs)


# -- function tools ---------------------------------------------------------------------------------------


def chat_tool(tool: dict) -> dict:
    """A Responses API function tool in chat's nested form."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def check_call(item, names: set[str]) -> None:
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
    assert item.type == "function_call" and item.name in names and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    jsonschema.validate(json.loads(item.arguments), schemas[item.name])


@pytest.mark.parametrize(
    "choice, names",
    [("required", {"get_weather", "get_time"}), ({"type": "function", "name": "get_time"}, {"get_time"})],
)
def test_forced_function_calls_whole_and_streamed(client, choice, names):
    ask = {"model": "m", "input": ASK, "tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": False,
           "max_output_tokens": 120, **GREEDY}  # fmt: skip
    response = client.responses.create(**ask)
    echoed = response.tool_choice
    assert response.status == "completed" and (echoed if isinstance(echoed, str) else echoed.to_dict()) == choice
    assert [t.name for t in response.tools] == ["get_weather", "get_time"] and response.parallel_tool_calls is False
    [call] = response.output
    check_call(call, names)
    # The same call as chat completions makes of the same request.
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": ASK}], tools=[chat_tool(WEATHER), chat_tool(TIME)],
        tool_choice=chat_choice, parallel_tool_calls=False, max_tokens=120, **GREEDY,
    ).choices[0].message.tool_calls  # fmt: skip
    assert [(c.function.name, c.function.arguments) for c in chat] == [(call.name, call.arguments)]
    assert response.usage.output_tokens > 0

    events = list(client.responses.create(**ask, stream=True))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, delta, done, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.status == "in_progress" and added.item.arguments == ""
    assert delta.delta == done.arguments == call.arguments and added.output_index == delta.output_index == 0
    assert added.item.id == delta.item_id == done.item_id == item_done.item.id
    [streamed] = completed.response.output
    assert (streamed.name, streamed.arguments, streamed.id) == (call.name, call.arguments, item_done.item.id)
    # The SDK's stream helper, which builds the response from the events.
    with client.responses.stream(**ask) as stream:
        [built] = stream.get_final_response().output
    assert (built.type, built.name, built.arguments) == ("function_call", call.name, call.arguments)


def test_function_call_round_trip(client):
    """function_call out, the client runs it, function_call_output back in: the conversation chat would render."""
    first = client.responses.create(
        model="m", input=[{"role": "user", "content": ASK}], tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, **GREEDY,
    )  # fmt: skip
    [call] = first.output
    check_call(call, {"get_weather"})
    # As a client sends it back: the earlier output items as they came, then the call's output.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}
    second = client.responses.create(
        model="m", input=[{"role": "user", "content": ASK}, *first.output, result], tools=[WEATHER],
        max_output_tokens=8, **GREEDY,
    )  # fmt: skip
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"},
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model="m", messages=history, tools=[chat_tool(WEATHER)], max_tokens=8, **GREEDY
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    message = chat.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert [(i.name, i.arguments) for i in second.output if i.type == "function_call"] == calls
    assert second.output_text == (message.content or "")
    # The output given as text parts, and tool_choice "none" (no tools shown): the same prompt as chat's.
    parts = {**result, "output": [{"type": "input_text", "text": "18 C"}, {"type": "input_text", "text": "and sunny"}]}
    again = client.responses.create(
        model="m", input=[{"role": "user", "content": ASK}, *first.output, parts], tools=[WEATHER],
        tool_choice="none", max_output_tokens=2, **GREEDY,
    )  # fmt: skip
    history[-1]["content"] = "18 C\nand sunny"
    plain = client.chat.completions.create(model="m", messages=history, max_tokens=2, **GREEDY)
    assert (
        again.usage.input_tokens == plain.usage.prompt_tokens and again.output_text == plain.choices[0].message.content
    )


def test_text_and_calls_of_one_answer_render_as_one_assistant_turn(client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "UTC"}'}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}
    response = client.responses.create(
        model="m", input=[{"role": "user", "content": "Time?"}, answer, call, result], tools=[TIME],
        max_output_tokens=2, **GREEDY,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ],
        tools=[chat_tool(TIME)], max_tokens=2, **GREEDY,
    )  # fmt: skip
    assert response.usage.input_tokens == chat.usage.prompt_tokens


class ScriptedStream:
    """A request's DELTA outputs as the engine sends them, one text piece a step: the route's events
    for answers a random model does not write."""

    def __init__(self, pieces: list[str], finish_reason: str) -> None:
        self.pieces, self.finish_reason = pieces, finish_reason

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self.outputs()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            choice = CompletionOutput(0, piece, [i], self.finish_reason if last else None)
            yield RequestOutput("r", None, [1, 2], [choice], last, RequestMetrics(0.0))

    def close(self) -> None:
        pass


def scripted_events(pieces: list[str], finish_reason: str) -> list[dict]:
    plan = ToolPlan(HERMES, [chat_tool(WEATHER), chat_tool(TIME)], "auto", None, True)
    response = p.ResponseObject(id="resp_1", status="in_progress", model="m", output=[])
    stream = ScriptedStream(pieces, finish_reason)

    async def collect() -> list[str]:
        return [e async for e in response_events(None, response, Prompt(None, [1, 2]), [stream], plan, None, "tools")]

    return [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(collect())]


def test_streamed_text_then_a_call_of_one_answer():
    """Hermes text before a <tool_call> block streams as the message's text; the call follows as its own item."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    events = scripted_events(["Let me ", "check.\n<tool", call[5:]], "stop")
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["delta"] for e in events[4:6]] == ["Let me ", "check.\n"]
    assert [e["output_index"] for e in events[2:-1]] == [0] * 7 + [1] * 4
    message, function_call = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == events[6]["text"] == "Let me check.\n"
    assert function_call["name"] == "get_time" and json.loads(function_call["arguments"]) == {"zone": "UTC"}
    assert events[9]["item"]["id"] == events[10]["item_id"] == function_call["id"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_call_cut_by_max_output_tokens_is_text():
    events = scripted_events(["Let me check.", ' <tool_call>\n{"name": "get_ti'], "length")
    response = events[-1]["response"]
    assert (
        events[-1]["type"] == "response.incomplete" and response["incomplete_details"]["reason"] == "max_output_tokens"
    )
    [message] = response["output"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert message["content"][0]["text"] == text == 'Let me check. <tool_call>\n{"name": "get_ti'
