"""/v1/responses: OpenAI's Responses API over the chat template, stateless.

The input (a text, or messages with text parts) and the instructions (a system message first) are
rendered as a chat; the answer is one assistant message with one output_text part, whole or streamed
as the Responses API's typed events. Nothing is stored: previous_response_id is refused, and
`store: true` is accepted but the response says `"store": false`.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tachyllm.engine.input_processor import Prompt
from tachyllm.sampling_params import RequestOutputKind, SamplingParams
from tachyllm.server import protocol as p
from tachyllm.server.admission import start_requests
from tachyllm.server.async_engine import EngineDeadError, RequestStream
from tachyllm.server.errors import APIError, bad_request, engine_dead
from tachyllm.server.openapi import route_doc
from tachyllm.server.output_stream import ChoiceProgress, choice_updates, final_outputs, merged
from tachyllm.server.parsing import parse_body
from tachyllm.server.prompts import chat_prompt
from tachyllm.server.responses import event_stream, finish_reason, json_response
from tachyllm.server.sampling import compile_constraint, format_constraint, resolve_max_tokens, with_defaults
from tachyllm.server.state import EngineClient, ServerState, server_state

router = APIRouter()


STREAM_EVENTS = (
    "with `stream: true`: the Responses API's events, `event: <type>` and `data: {type, sequence_number, ...}`: "
    "response.created, response.in_progress, response.output_item.added, response.content_part.added, "
    "response.output_text.delta..., response.output_text.done, response.content_part.done, "
    "response.output_item.done, then response.completed or response.incomplete (response.failed on a failure)"
)


@router.post("/v1/responses", **route_doc(p.ResponsesRequest, p.ResponseObject, generates=True, events=STREAM_EVENTS))
async def create_response(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.ResponsesRequest)
    model = state.model(body.model)
    reject_unsupported(body)
    prompt = await chat_prompt(model, input_messages(body), param="input")
    max_tokens = resolve_max_tokens(model, body.max_output_tokens, len(prompt.token_ids), "input", "max_output_tokens")
    params = sampling_params(body, max_tokens, model.sampling_defaults)
    state.check_requested_tokens([prompt], [params], "max_output_tokens")
    await compile_constraint(model, params, "text.format")
    response = response_object(body, model.name, f"resp_{uuid.uuid4().hex}")
    streams = await start_requests(state, model, response.id, [prompt], [params], "input")
    if body.stream:
        return event_stream(response_events(model.engine, response, prompt, streams))
    finals = await final_outputs(request, streams)
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    out = finals[0]
    choice = out.outputs[0]
    finish(response, choice.text, finish_reason(out, choice, "text.format"), prompt, len(choice.token_ids))
    return json_response(response)


def reject_unsupported(body: p.ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise bad_request(p.UNSUPPORTED_FIELDS["previous_response_id"], param="previous_response_id")
    if body.tools:
        raise bad_request("tools are not supported on /v1/responses; use /v1/chat/completions", param="tools")
    if body.tool_choice is not None and body.tool_choice not in ("none", "auto"):
        raise bad_request('tool_choice must be "none" or "auto" (no tools are served here)', param="tool_choice")
    if body.truncation is not None and body.truncation != "disabled":
        raise bad_request('only truncation "disabled" is supported', param="truncation")


def input_messages(body: p.ResponsesRequest) -> list[p.ChatMessage]:
    """The conversation: the instructions as a system message, then the input."""
    messages = [] if body.instructions is None else [p.ChatMessage(role="system", content=body.instructions)]
    if isinstance(body.input, str):
        return [*messages, p.ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        content = item.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"input[{i}].content[{j}]"
                if part.type not in ("input_text", "output_text"):
                    raise bad_request(f"only text content parts are supported, got type {part.type!r}", param=where)
                if part.text is None:
                    raise bad_request(
                        f"a content part of type {part.type!r} needs a 'text' field", param=f"{where}.text"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        messages.append(p.ChatMessage(role=item.role, content=content))
    return messages


def sampling_params(body: p.ResponsesRequest, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
    fmt = body.text.format if body.text is not None else None
    constraint = None if fmt is None else format_constraint(fmt.type, fmt.schema_, "text.format", "text.format.schema")
    options = {"temperature": body.temperature, "top_p": body.top_p}
    # Unset (None) fields take the model's generation-config defaults, else SamplingParams' (OpenAI's).
    return SamplingParams(
        max_tokens=max_tokens,
        structured_outputs=constraint,
        output_kind=RequestOutputKind.DELTA,
        **with_defaults(options, defaults),
    )


def response_object(body: p.ResponsesRequest, model_name: str, response_id: str) -> p.ResponseObject:
    """The response as it starts: in progress, nothing output yet, the request's settings echoed."""
    fmt = body.text.format if body.text is not None else None
    return p.ResponseObject(
        id=response_id,
        status="in_progress",
        model=model_name,
        output=[],
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
        tool_choice=body.tool_choice if isinstance(body.tool_choice, str) else "none",
        parallel_tool_calls=bool(body.parallel_tool_calls),
        metadata=body.metadata or {},
        user=body.user,
    )


def output_message(item_id: str, text: str, status: str) -> p.ResponseOutputMessage:
    return p.ResponseOutputMessage(id=item_id, status=status, content=[p.ResponseOutputText(text=text)])


def finish(response: p.ResponseObject, text: str, reason: str | None, prompt: Prompt, num_output_tokens: int) -> None:
    """Completes `response` with its answer: incomplete when max_output_tokens (or the context) cut it."""
    status = "incomplete" if reason == "length" else "completed"
    response.status = status
    response.incomplete_details = {"reason": "max_output_tokens"} if status == "incomplete" else None
    response.output = [output_message(f"msg_{response.id.removeprefix('resp_')}", text, status)]
    num_input_tokens = len(prompt.token_ids)
    response.usage = p.ResponseUsage(
        input_tokens=num_input_tokens,
        output_tokens=num_output_tokens,
        total_tokens=num_input_tokens + num_output_tokens,
    )


async def response_events(
    engine: EngineClient, response: p.ResponseObject, prompt: Prompt, streams: list[RequestStream]
) -> AsyncIterator[str]:
    """The Responses API's events: created, in_progress, the message and its text part added, the text's
    deltas, then each done in turn and completed (or incomplete); a failure midway ends the stream
    with response.failed."""
    numbers = itertools.count()
    item_id = f"msg_{response.id.removeprefix('resp_')}"
    where: dict[str, Any] = {"item_id": item_id, "output_index": 0, "content_index": 0}

    def event(kind: str, **fields: Any) -> str:
        data = p.ResponseStreamEvent(type=kind, sequence_number=next(numbers), **fields)
        return f"event: {kind}\ndata: {data.model_dump_json()}\n\n"

    try:
        yield event("response.created", response=response.model_dump())
        yield event("response.in_progress", response=response.model_dump())
        item = output_message(item_id, "", "in_progress").model_copy(update={"content": []})
        yield event("response.output_item.added", output_index=0, item=item.model_dump())
        yield event("response.content_part.added", **where, part=p.ResponseOutputText(text="").model_dump())
        progress, texts, reason = [ChoiceProgress()], [], None
        async for _, out in merged(streams):
            for update in choice_updates(out, progress, 0, "text.format"):
                if update.text:
                    texts.append(update.text)
                    yield event("response.output_text.delta", **where, delta=update.text, logprobs=[])
                reason = update.finish_reason or reason
        finish(response, "".join(texts), reason, prompt, progress[0].num_tokens)
        message = response.output[0]
        part = message.content[0]
        yield event("response.output_text.done", **where, text=part.text, logprobs=[])
        yield event("response.content_part.done", **where, part=part.model_dump())
        yield event("response.output_item.done", output_index=0, item=message.model_dump())
        done = "response.completed" if response.status == "completed" else "response.incomplete"
        yield event(done, response=response.model_dump())
    except (APIError, EngineDeadError) as e:
        error = (e if isinstance(e, APIError) else engine_dead(e, engine.error is not None)).body.error
        response.status = "failed"
        response.error = p.ResponseError(code=error.code or error.type, message=error.message)
        yield event("response.failed", response=response.model_dump())
    finally:
        for stream in streams:  # merged() closes them too, but a client may leave before it starts
            stream.close()
