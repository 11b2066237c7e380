"""/v1/completions: one engine request per prompt, answered whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tachyllm.engine.input_processor import Prompt
from tachyllm.server import protocol as p
from tachyllm.server.admission import start_requests
from tachyllm.server.async_engine import RequestStream
from tachyllm.server.openapi import route_doc
from tachyllm.server.output_stream import ChoiceProgress, choice_updates, final_outputs, merged
from tachyllm.server.parsing import parse_generation_request
from tachyllm.server.prompts import completion_prompts
from tachyllm.server.responses import (
    SSE_DONE,
    completion_logprobs,
    event_stream,
    finish_reason,
    json_response,
    sse,
    stream_errors,
    usage,
)
from tachyllm.server.sampling import (
    compile_constraint,
    constraint_field,
    logit_bias,
    resolve_max_tokens,
    sampling_params,
)
from tachyllm.server.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/completions", **route_doc(p.CompletionRequest, p.CompletionResponse, generates=True))
async def completions(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body, model = await parse_generation_request(request, p.CompletionRequest, state)
    bias = logit_bias(body.logit_bias)
    prompts = await completion_prompts(state, model, body.prompt)
    params = [
        sampling_params(
            body,
            resolve_max_tokens(model, body.max_tokens, len(pr.token_ids), "prompt", "max_tokens"),
            body.logprobs,
            bias,
        )
        for pr in prompts
    ]
    state.check_requested_tokens(prompts, params, "max_tokens")
    await compile_constraint(model, params[0], constraint_field(body) or "structured_outputs")
    engine = model.engine
    if body.echo and (missing := [pr for pr in prompts if pr.text is None]):
        texts = await asyncio.to_thread(
            lambda: [engine.tokenizer.decode(pr.token_ids, skip_special_tokens=False) for pr in missing]
        )
        for pr, text in zip(missing, texts):
            pr.text = text
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await start_requests(state, model, request_id, prompts, params, "prompt")
    if body.stream:
        return event_stream(stream_errors(engine, completion_events(model.name, body, request_id, prompts, streams)))
    finals = await final_outputs(request, streams)
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    n, choices, num_output_tokens = body.n or 1, [], 0
    for i, (pr, out) in enumerate(zip(prompts, finals)):
        prefix = pr.text if body.echo else ""
        for c in out.outputs:
            logprobs = None if body.logprobs is None else completion_logprobs(c, 0, body.logprobs, len(prefix))
            reason = finish_reason(out, c)
            choice = p.CompletionChoice(
                index=i * n + c.index, text=prefix + c.text, logprobs=logprobs, finish_reason=reason
            )
            choices.append(choice)
            num_output_tokens += len(c.token_ids)
    return json_response(
        p.CompletionResponse(id=request_id, model=model.name, choices=choices, usage=usage(prompts, num_output_tokens))
    )


async def completion_events(
    model_name: str, body: p.CompletionRequest, request_id: str, prompts: list[Prompt], streams: list[RequestStream]
) -> AsyncIterator[str]:
    n, created = body.n or 1, int(time.time())
    progress = [ChoiceProgress() for _ in range(len(prompts) * n)]
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats

    def chunk(choices: list[p.CompletionChoice], usage_info: p.UsageInfo | None = None) -> str:
        return sse(
            p.CompletionResponse(id=request_id, created=created, model=model_name, choices=choices, usage=usage_info)
        )

    try:
        if body.echo:
            for i, pr in enumerate(prompts):
                for j in range(n):
                    progress[i * n + j].text_offset = len(pr.text)
                    yield chunk([p.CompletionChoice(index=i * n + j, text=pr.text)])
        num_output_tokens = 0
        async for i, out in merged(streams):
            for update in choice_updates(out, progress, i * n):
                logprobs = None
                if body.logprobs is not None:
                    pg = update.progress
                    logprobs = completion_logprobs(update.choice, 0, body.logprobs, pg.text_offset)
                    pg.text_offset += sum(map(len, logprobs.tokens))
                if update.finish_reason is not None:
                    num_output_tokens += update.progress.num_tokens
                choice = p.CompletionChoice(
                    index=update.index, text=update.text, logprobs=logprobs, finish_reason=update.finish_reason
                )
                yield chunk([choice], usage(prompts, sum(pg.num_tokens for pg in progress)) if continuous else None)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage(prompts, num_output_tokens))
        yield SSE_DONE
    finally:
        for stream in streams:  # merged() closes them too, but a client may leave before it starts
            stream.close()
