"""/v1/responses: OpenAI's Responses API over the chat template, stateless.

The input (a text, or items: messages with text parts, function calls an earlier response made and
their outputs) and the instructions (a system message first) are rendered as a chat; function tools
are served by chat's tool machinery (tools.py). The answer is an assistant message with one
output_text part and / or function_call items, whole or streamed as the Responses API's typed events.
Nothing is stored: previous_response_id and background are refused, and `store: true` is accepted but
the response says `"store": false`.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tachyllm.engine.input_processor import Prompt
from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tachyllm.server import protocol as p
from tachyllm.server.admission import start_requests
from tachyllm.server.async_engine import EngineDeadError, OutputStream
from tachyllm.server.errors import APIError, bad_request, engine_dead
from tachyllm.server.openapi import route_doc
from tachyllm.server.output_stream import ChoiceProgress, choice_updates, final_outputs, merged
from tachyllm.server.parsing import parse_body
from tachyllm.server.prompts import chat_prompt
from tachyllm.server.responses import chat_logprobs, event_stream, finish_reason, json_response
from tachyllm.server.sampling import compile_constraint, format_constraint, resolve_max_tokens, with_defaults
from tachyllm.server.state import EngineClient, ServerState, server_state
from tachyllm.server.tools import ToolCall, ToolCallStream, ToolPlan, check_tool_schemas, tool_plan

router = APIRouter()


STREAM_EVENTS = (
    "with `stream: true`: the Responses API's events, `event: <type>` and `data: {type, sequence_number, ...}`: "
    "response.created, response.in_progress; for the answer's message response.output_item.added, "
    "response.content_part.added, response.output_text.delta..., response.output_text.done, "
    "response.content_part.done, response.output_item.done; for each function call response.output_item.added, "
    "response.function_call_arguments.delta, response.function_call_arguments.done, response.output_item.done; "
    "then response.completed or response.incomplete (response.failed on a failure)"
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@router.post("/v1/responses", **route_doc(p.ResponsesRequest, p.ResponseObject, generates=True, events=STREAM_EVENTS))
async def create_response(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body = await parse_body(request, p.ResponsesRequest)
    model = state.model(body.model)
    model.check_task("generate", request.url.path)
    reject_unsupported(body)
    messages = input_messages(body)
    plan = response_tool_plan(body, messages, model.engine.tokenizer, model.tool_call_parser)
    if plan is not None:
        await check_tool_schemas(model.processor.grammars, plan)
    prompt = await chat_prompt(model, messages, plan, param="input")
    max_tokens = resolve_max_tokens(model, body.max_output_tokens, len(prompt.token_ids), "input", "max_output_tokens")
    tool_constraint = plan.constraint(model.processor.grammars) if plan is not None else None
    params = sampling_params(body, max_tokens, tool_constraint, model.sampling_defaults)
    if plan is not None and plan.keep_special_tokens:
        params.skip_special_tokens = False
    state.check_requested_tokens([prompt], [params], "max_output_tokens")
    constraint_param = "tools" if tool_constraint is not None else "text.format"
    await compile_constraint(model, params, constraint_param)
    response = response_object(body, model.name, f"resp_{uuid.uuid4().hex}")
    streams = await start_requests(state, model, response.id, [prompt], [params], "input")
    top_logprobs = params.logprobs
    if body.stream:
        return event_stream(
            response_events(model.engine, response, prompt, streams, plan, top_logprobs, constraint_param)
        )
    finals = await final_outputs(request, streams)
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    out = finals[0]
    choice = out.outputs[0]
    answer = Answer(choice.text, reason=finish_reason(out, choice, constraint_param), num_tokens=len(choice.token_ids))
    if plan is not None:
        assert answer.reason is not None, "finish_reason of a final output"
        content, answer.calls, answer.reason = plan.answer(choice.text, answer.reason)
        answer.text = content or ""
    if top_logprobs is not None:
        answer.logprobs = chat_logprobs(choice, 0, top_logprobs).content
    finish(response, answer, prompt)
    return json_response(response)


def reject_unsupported(body: p.ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise bad_request(p.UNSUPPORTED_FIELDS["previous_response_id"], param="previous_response_id")
    if body.background:
        raise bad_request(
            "background responses are not supported: nothing is stored to poll (stream the response to follow it)",
            param="background",
        )
    for i, value in enumerate(body.include or []):
        if value not in p.RESPONSE_INCLUDES:
            raise bad_request(
                f"include value {value!r} is not supported; this server includes {' and '.join(p.RESPONSE_INCLUDES)}",
                param=f"include[{i}]",
            )
    if body.truncation is not None and body.truncation != "disabled":
        raise bad_request('only truncation "disabled" is supported', param="truncation")


def input_messages(body: p.ResponsesRequest) -> list[p.ChatMessage]:
    """The conversation as chat messages: the instructions as a system message, then the input's items.
    An earlier answer's function calls join its assistant message (the calls and text one answer made),
    and each function call's output is a tool message answering its call_id."""
    messages = [] if body.instructions is None else [p.ChatMessage(role="system", content=body.instructions)]
    if isinstance(body.input, str):
        return [*messages, p.ChatMessage(role="user", content=body.input)]
    for i, item in enumerate(body.input):
        kind = checked_item_type(item, f"input[{i}]")
        # checked_item_type found the fields each kind requires (RESPONSE_ITEM_REQUIRED).
        if kind == "message":
            assert item.role is not None and item.content is not None
            messages.append(p.ChatMessage(role=item.role, content=part_texts(item.content, f"input[{i}].content")))
        elif kind == "function_call":
            assert item.call_id is not None and item.name is not None and item.arguments is not None
            call = p.ToolCallIn(id=item.call_id, function=p.FunctionCallIn(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(p.ChatMessage(role="assistant", tool_calls=[call]))
        else:
            assert item.output is not None
            output = part_texts(item.output, f"input[{i}].output")
            messages.append(p.ChatMessage(role="tool", content=output, tool_call_id=item.call_id, name=item.name))
    return messages


def checked_item_type(item: p.ResponseInputItem, where: str) -> str:
    """The item's type (a message when it has none), once its fields are those of that type."""
    kind = item.type or "message"
    if kind not in p.RESPONSE_ITEM_FIELDS:
        raise bad_request(
            f"input items of type {kind!r} are not supported; send messages, function_call and "
            "function_call_output items (nothing is stored, so no item can be referred to by its id)",
            param=f"{where}.type",
        )
    given = {name for name in item.model_fields_set if getattr(item, name) is not None}
    foreign = sorted(given - set(p.RESPONSE_ITEM_FIELDS[kind]))
    if foreign:
        raise bad_request(f"{foreign[0]} is not a field of a {kind} item", param=f"{where}.{foreign[0]}")
    missing = [name for name in p.RESPONSE_ITEM_REQUIRED[kind] if name not in given]
    if missing:
        raise bad_request(f"a {kind} item needs {missing[0]}", param=f"{where}.{missing[0]}")
    return kind


def part_texts(content: str | list[p.ResponseContentPart], where: str) -> str:
    """A message's content (or a function call's output): a string, or text parts joined with newlines."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text"):
            raise bad_request(f"only text content parts are supported, got type {part.type!r}", param=f"{where}[{j}]")
        if part.text is None:
            raise bad_request(f"a content part of type {part.type!r} needs a 'text' field", param=f"{where}[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)


def response_tool_plan(
    body: p.ResponsesRequest, messages: list[p.ChatMessage], tokenizer: Tokenizer, parser: str | None
) -> ToolPlan | None:
    """The request's function tools as chat's tool plan (tools.py): the flat tools and the named
    tool_choice nested as chat has them. No tools with tool_choice "auto" or "none" mean no tools."""
    if isinstance(body.tool_choice, str) and body.tool_choice not in ("none", "auto", "required"):
        raise bad_request(
            f'tool_choice must be "none", "auto", "required" or a function, got {body.tool_choice!r}',
            param="tool_choice",
        )
    if not body.tools:
        if body.tool_choice in (None, "none", "auto"):
            return None
        raise bad_request("tool_choice needs tools", param="tool_choice")
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.type != "function":
            raise bad_request(f"only function tools are served, got type {tool.type!r}", param=f"tools[{i}].type")
        if tool.name is None:
            raise bad_request("a function tool needs a name", param=f"tools[{i}].name")
        function = p.FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
        )
        tools.append(p.Tool(type="function", function=function))
    choice = body.tool_choice
    # A string was checked above to be one of chat's three.
    chat_choice = cast(Literal["none", "auto", "required"] | p.NamedToolChoice | None, choice)
    if isinstance(choice, p.ResponseToolChoice):
        if choice.type != "function":
            raise bad_request(
                f'tool_choice must be "none", "auto", "required" or a function, got type {choice.type!r}',
                param="tool_choice.type",
            )
        if choice.name is None:
            raise bad_request("a function tool_choice needs a name", param="tool_choice.name")
        chat_choice = p.NamedToolChoice(type="function", function=p.NamedFunction(name=choice.name))
    as_chat = p.ChatCompletionRequest(
        messages=messages, tools=tools, tool_choice=chat_choice, parallel_tool_calls=body.parallel_tool_calls
    )
    return tool_plan(as_chat, tokenizer, parser)


def output_logprobs(body: p.ResponsesRequest) -> int | None:
    """How many alternatives each output token's logprob entry holds, if the output_text carries logprobs:
    with include message.output_text.logprobs, or top_logprobs (which asks for them)."""
    if LOGPROBS_INCLUDE in (body.include or []) or body.top_logprobs is not None:
        return body.top_logprobs or 0
    return None


def sampling_params(
    body: p.ResponsesRequest,
    max_tokens: int,
    tool_constraint: StructuredOutputsParams | None,
    defaults: dict[str, Any],
) -> SamplingParams:
    """`tool_constraint`: the grammar of a tool_choice that forces a call."""
    fmt = body.text.format if body.text is not None else None
    constraint = None if fmt is None else format_constraint(fmt.type, fmt.schema_, "text.format", "text.format.schema")
    if constraint is not None and tool_constraint is not None:
        raise bad_request(
            'text.format cannot be combined with a tool_choice that forces a call ("required" or a function)',
            param="text.format",
        )
    options = {"temperature": body.temperature, "top_p": body.top_p, "logprobs": output_logprobs(body)}
    # Unset (None) fields take the model's generation-config defaults, else SamplingParams' (OpenAI's).
    return SamplingParams(
        max_tokens=max_tokens,
        structured_outputs=constraint or tool_constraint,
        output_kind=RequestOutputKind.DELTA,
        **with_defaults(options, defaults),
    )


def response_object(body: p.ResponsesRequest, model_name: str, response_id: str) -> p.ResponseObject:
    """The response as it starts: in progress, nothing output yet, the request's settings echoed."""
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice
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
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
        tool_choice=choice.model_dump(exclude_none=True)
        if isinstance(choice, p.ResponseToolChoice)
        else choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        top_logprobs=body.top_logprobs,
        metadata=body.metadata or {},
        user=body.user,
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
    )


@dataclass
class Answer:
    """What the model answered: the message's text (none when the answer is only calls), its calls."""

    text: str
    calls: list[ToolCall] = field(default_factory=list)
    reason: str | None = None
    num_tokens: int = 0
    logprobs: list[p.ChatTokenLogprob] = field(default_factory=list)  # of every output token


def message_id(response: p.ResponseObject) -> str:
    return f"msg_{response.id.removeprefix('resp_')}"


ItemStatus = Literal["in_progress", "completed", "incomplete"]


def output_message(
    item_id: str, text: str, status: ItemStatus, logprobs: list[p.ChatTokenLogprob] | None = None
) -> p.ResponseOutputMessage:
    part = p.ResponseOutputText(text=text, logprobs=logprobs or [])
    return p.ResponseOutputMessage(id=item_id, status=status, content=[part])


def finish(response: p.ResponseObject, answer: Answer, prompt: Prompt) -> None:
    """Completes `response` with its answer: a message (unless the answer is only calls), then a
    function_call item per call; incomplete when max_output_tokens (or the context) cut it."""
    status: ItemStatus = "incomplete" if answer.reason == "length" else "completed"
    response.status = status
    response.incomplete_details = {"reason": "max_output_tokens"} if status == "incomplete" else None
    output: list[p.ResponseOutputMessage | p.ResponseFunctionCall] = []
    if answer.text or not answer.calls:
        output.append(output_message(message_id(response), answer.text, status, answer.logprobs))
    for call in answer.calls:
        output.append(
            p.ResponseFunctionCall(
                id=f"fc_{uuid.uuid4().hex}", status=status, call_id=call.id, name=call.name, arguments=call.arguments
            )
        )
    response.output = output
    num_input_tokens = len(prompt.token_ids)
    response.usage = p.ResponseUsage(
        input_tokens=num_input_tokens,
        output_tokens=answer.num_tokens,
        total_tokens=num_input_tokens + answer.num_tokens,
    )


async def response_events(
    engine: EngineClient,
    response: p.ResponseObject,
    prompt: Prompt,
    streams: Sequence[OutputStream],
    plan: ToolPlan | None,
    top_logprobs: int | None,
    constraint_param: str,
) -> AsyncIterator[str]:
    """The Responses API's events: created, in_progress; the message and its text part added (with
    tools, when its first text comes), the text's deltas; at the end each item done in turn (a
    function call's whole arguments as one delta), then completed (or incomplete). Text that may be a
    tool call is held back (tools.ToolCallStream). A failure midway ends the stream with response.failed."""
    numbers = itertools.count()
    where: dict[str, Any] = {"item_id": message_id(response), "output_index": 0, "content_index": 0}

    def event(kind: str, **fields: Any) -> str:
        data = p.ResponseStreamEvent(type=kind, sequence_number=next(numbers), **fields)
        return f"event: {kind}\ndata: {data.model_dump_json()}\n\n"

    def message_added() -> list[str]:
        item = output_message(where["item_id"], "", "in_progress").model_copy(update={"content": []})
        return [
            event("response.output_item.added", output_index=0, item=item.model_dump()),
            event("response.content_part.added", **where, part=p.ResponseOutputText(text="").model_dump()),
        ]

    try:
        yield event("response.created", response=response.model_dump())
        yield event("response.in_progress", response=response.model_dump())
        held = ToolCallStream(plan) if plan is not None else None
        # Without tools the answer is a message, opened at once; with tools it may be only calls.
        opened = held is None
        if opened:
            for opening in message_added():
                yield opening
        progress, answer = [ChoiceProgress()], Answer("")
        sent_logprobs = 0  # entries of answer.logprobs that went out with deltas
        async for _, out in merged(streams):
            for update in choice_updates(out, progress, 0, constraint_param):
                text, answer.reason = update.text, update.finish_reason or answer.reason
                if top_logprobs is not None:
                    answer.logprobs += chat_logprobs(update.choice, 0, top_logprobs).content
                if held is not None:
                    text = held.feed(text)
                    if update.finish_reason is not None:
                        rest, answer.calls, answer.reason = held.finish(update.finish_reason)
                        text += rest
                if not text:
                    continue
                if not opened:
                    for opening in message_added():
                        yield opening
                    opened = True
                answer.text += text
                # A delta's logprobs: its tokens', and those of tokens held back before it.
                logprobs = [lp.model_dump() for lp in answer.logprobs[sent_logprobs:]]
                sent_logprobs = len(answer.logprobs)
                yield event("response.output_text.delta", **where, delta=text, logprobs=logprobs)
        answer.num_tokens = progress[0].num_tokens
        finish(response, answer, prompt)
        for index, item in enumerate(response.output):
            if isinstance(item, p.ResponseOutputMessage):
                if not opened:
                    for opening in message_added():
                        yield opening
                part = item.content[0]
                yield event(
                    "response.output_text.done", **where, text=part.text, logprobs=part.model_dump()["logprobs"]
                )
                yield event("response.content_part.done", **where, part=part.model_dump())
            else:
                added = item.model_copy(update={"status": "in_progress", "arguments": ""})
                yield event("response.output_item.added", output_index=index, item=added.model_dump())
                call = {"item_id": item.id, "output_index": index}
                yield event("response.function_call_arguments.delta", **call, delta=item.arguments)
                yield event("response.function_call_arguments.done", **call, arguments=item.arguments)
            yield event("response.output_item.done", output_index=index, item=item.model_dump())
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
