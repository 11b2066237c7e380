"""POST /v1/responses (issue #20, point 5): OpenAI's Responses API over the chat template, stateless;
driven by the official openai client (client.responses.create), whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from test_server import running_server

from tachyllm import faults

GREEDY = {"temperature": 0}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
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


@pytest.fixture(scope="module")
def url(tiny_model_factory) -> Iterator[str]:
    with running_server(str(tiny_model_factory("llama")), "--served-model-name", "m") as base:
        yield base


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
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "tools", "not supported"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", "none"),
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
