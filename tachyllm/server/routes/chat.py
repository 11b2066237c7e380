"""/v1/chat/completions: the conversation in the model's chat template, answered whole or streamed as
server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tachyllm.engine.input_processor import Prompt, truncated
from tachyllm.server import protocol as p
from tachyllm.server.admission import start_requests
from tachyllm.server.async_engine import OutputStream
from tachyllm.server.openapi import route_doc
from tachyllm.server.output_stream import ChoiceProgress, choice_updates, final_outputs, merged
from tachyllm.server.parsing import parse_generation_request
from tachyllm.server.prompts import chat_prompt
from tachyllm.server.responses import (
    SSE_DONE,
    chat_logprobs,
    event_stream,
    finish_reason,
    json_response,
    prompt_logprobs,
    sse,
    stream_errors,
    usage,
)
from tachyllm.server.sampling import (
    compile_constraint,
    constraint_param,
    logit_bias,
    resolve_max_tokens,
    sampling_params,
)
from tachyllm.server.state import ServerState, server_state
from tachyllm.server.tools import ToolCall, ToolCallStream, ToolPlan, check_tool_schemas, tool_plan

router = APIRouter()


@router.post("/v1/chat/completions", **route_doc(p.ChatCompletionRequest, p.ChatCompletionResponse, generates=True))
async def chat_completions(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body, model = await parse_generation_request(request, p.ChatCompletionRequest, state)
    bias = logit_bias(body.logit_bias)
    plan = tool_plan(body, model.engine.tokenizer, model.tool_call_parser)
    if plan is not None:
        await check_tool_schemas(model.processor.grammars, plan)
    prompt = await chat_prompt(
        model,
        body.messages,
        plan,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_vars=body.chat_template_kwargs,
    )
    prompt = truncated(prompt, body.truncate_prompt_tokens, model.engine.max_model_len)
    requested, max_param = body.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, max_param = body.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(model, requested, len(prompt.token_ids), "messages", max_param)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    constraint = plan.constraint(model.processor.grammars) if plan is not None else None
    params = sampling_params(body, max_tokens, top_logprobs, bias, constraint, defaults=model.sampling_defaults)
    if plan is not None and plan.keep_special_tokens:
        params.skip_special_tokens = False
    state.check_requested_tokens([prompt], [params], max_param)
    await compile_constraint(model, params, constraint_param(body))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await start_requests(state, model, request_id, [prompt], [params], "messages")
    if body.stream:
        events = chat_events(model.name, body, request_id, prompt, streams, plan)
        return event_stream(stream_errors(model.engine, events))
    finals = await final_outputs(request, streams)
    if finals is None:
        return Response(status_code=499)
    out = finals[0]
    choices = []
    for c in out.outputs:
        reason, message = finish_reason(out, c, constraint_param(body)), p.AssistantMessage(content=c.text)
        assert reason is not None, "finish_reason of a final output"
        if plan is not None:
            content, calls, reason = plan.answer(c.text, reason)
            message = p.AssistantMessage(content=content, tool_calls=tool_calls(calls) or None)
        logprobs = None if top_logprobs is None else chat_logprobs(c, 0, top_logprobs)
        choices.append(p.ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=reason))
    num_output_tokens = sum(len(c.token_ids) for c in out.outputs)
    return json_response(
        p.ChatCompletionResponse(
            id=request_id,
            model=model.name,
            choices=choices,
            usage=usage([prompt], num_output_tokens),
            prompt_logprobs=prompt_logprobs(out, body.prompt_logprobs),
        )
    )


def tool_calls(calls: list[ToolCall]) -> list[p.ToolCall]:
    return [p.ToolCall(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


async def chat_events(
    model_name: str,
    body: p.ChatCompletionRequest,
    request_id: str,
    prompt: Prompt,
    streams: Sequence[OutputStream],
    plan: ToolPlan | None,
) -> AsyncIterator[str]:
    n, created = body.n or 1, int(time.time())
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    progress = [ChoiceProgress() for _ in range(n)]
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
    # With tools, what may be a tool call is held back, then sent as calls (or as content after all).
    tool_streams = [ToolCallStream(plan) for _ in range(n)] if plan is not None else None
    param = constraint_param(body)

    def chunk(choices: list[p.ChatChunkChoice], usage_info: p.UsageInfo | None = None) -> str:
        return sse(
            p.ChatCompletionChunk(id=request_id, created=created, model=model_name, choices=choices, usage=usage_info)
        )

    try:
        # Each choice's role goes out with its first content (vLLM's timing): a client that takes the
        # first event for the first token measures the real time to first token.
        started = [False] * n
        num_output_tokens = 0
        async for _, out in merged(streams):
            for update in choice_updates(out, progress, 0, param):
                logprobs = None
                if top_logprobs is not None:
                    logprobs = chat_logprobs(update.choice, 0, top_logprobs)
                text, reason = update.text, update.finish_reason
                calls: list[ToolCall] = []
                if reason is not None:
                    num_output_tokens += update.progress.num_tokens
                if tool_streams is not None:
                    held = tool_streams[update.index]
                    text = held.feed(text)
                    if reason is not None:
                        rest, calls, reason = held.finish(reason)
                        text += rest
                    if not text and reason is None and logprobs is None:
                        continue  # held back, and nothing else to send
                deltas = [
                    p.ToolCallDelta(
                        index=k,
                        id=c.id,
                        type="function",
                        function=p.FunctionCallDelta(name=c.name, arguments=c.arguments),
                    )
                    for k, c in enumerate(calls)
                ]
                role: Literal["assistant"] | None = None if started[update.index] else "assistant"
                started[update.index] = True
                choice = p.ChatChunkChoice(
                    index=update.index,
                    delta=p.ChatDelta(role=role, content=text or None, tool_calls=deltas or None),
                    logprobs=logprobs,
                    finish_reason=reason,
                )
                yield chunk([choice], usage([prompt], sum(pg.num_tokens for pg in progress)) if continuous else None)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage([prompt], num_output_tokens))
        yield SSE_DONE
    finally:
        for stream in streams:
            stream.close()
