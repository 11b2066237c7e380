"""/v1/completions: one engine request per prompt, answered whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from tachyllm.engine.input_processor import Prompt, truncated
from tachyllm.loading.tokenizer import Tokenizer
from tachyllm.outputs import CompletionOutput, DeltaAccumulator, RequestOutput
from tachyllm.server import protocol as p
from tachyllm.server.admission import start_requests
from tachyllm.server.async_engine import OutputStream
from tachyllm.server.openapi import route_doc
from tachyllm.server.output_stream import ChoiceProgress, choice_updates, final_outputs, merged
from tachyllm.server.parsing import parse_generation_request
from tachyllm.server.prompts import completion_prompts
from tachyllm.server.responses import (
    SSE_DONE,
    completion_logprobs,
    echo_logprobs,
    event_stream,
    finish_reason,
    joined_logprobs,
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

router = APIRouter()


@router.post("/v1/completions", **route_doc(p.CompletionRequest, p.CompletionResponse, generates=True))
async def completions(request: Request, state: ServerState = Depends(server_state)) -> Response:
    body, model = await parse_generation_request(request, p.CompletionRequest, state)
    bias = logit_bias(body.logit_bias)
    prompts = [
        truncated(pr, body.truncate_prompt_tokens, model.engine.max_model_len)
        for pr in await completion_prompts(state, model, body.prompt)
    ]
    params = [
        sampling_params(
            body,
            # max_tokens 0 (echo): the engine samples one token, which the response leaves out (vLLM's way).
            max(1, resolve_max_tokens(model, body.max_tokens, len(pr.token_ids), "prompt", "max_tokens")),
            body.logprobs,
            bias,
            defaults=model.sampling_defaults,
        )
        for pr in prompts
    ]
    state.check_requested_tokens(prompts, params, "max_tokens")
    await compile_constraint(model, params[0], constraint_param(body))
    engine = model.engine
    echoes = await asyncio.to_thread(echo_texts, engine.tokenizer, prompts, body) if body.echo else None
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await start_requests(state, model, request_id, prompts, params, "prompt")
    if body.stream:
        events = completion_events(model.name, body, request_id, prompts, echoes, streams)
        return event_stream(stream_errors(engine, events))
    finals = await final_outputs(request, streams)
    if finals is None:
        return Response(status_code=499)  # nobody is listening
    n, choices, num_output_tokens = body.n or 1, [], 0
    for i, out in enumerate(finals):
        echo = echoes[i] if echoes else None
        entries = prompt_logprobs(out, body.prompt_logprobs)
        for c in out.outputs:
            reason = finish_reason(out, c, constraint_param(body))
            if echo_only(body):
                assert echo is not None, "echo_only needs echo"
                choice = echo_choice(body, echo, out, i * n + c.index, "length")
            else:
                choice = generated_choice(body, echo, out, c, i * n + c.index, reason)
                num_output_tokens += len(c.token_ids)
            choice.prompt_logprobs = entries
            choices.append(choice)
    return json_response(
        p.CompletionResponse(id=request_id, model=model.name, choices=choices, usage=usage(prompts, num_output_tokens))
    )


def echo_only(body: p.CompletionRequest) -> bool:
    """echo with max_tokens 0: the prompt alone, finish_reason "length" (OpenAI's and vLLM's answer)."""
    return body.echo and body.max_tokens == 0


@dataclass
class Echo:
    """An echoed prompt: its text and token ids, and its first token's text (which no logprob entry names)."""

    text: str
    token_ids: list[int]
    first_token: str


def echo_texts(tokenizer: Tokenizer, prompts: list[Prompt], body: p.CompletionRequest) -> list[Echo]:
    """Each prompt's echo (its text decoded, when it came as token ids)."""
    echoes = []
    for pr in prompts:
        text = pr.text if pr.text is not None else tokenizer.decode(pr.token_ids, skip_special_tokens=False)
        first = tokenizer.decode(pr.token_ids[:1], skip_special_tokens=False) if body.logprobs is not None else ""
        echoes.append(Echo(text, pr.token_ids, first))
    return echoes


def echo_choice(
    body: p.CompletionRequest, echo: Echo, out: RequestOutput, index: int, reason: str | None
) -> p.CompletionChoice:
    """The prompt's part of a choice: its text and, with logprobs, the prompt tokens' (legacy shape)."""
    logprobs = None
    if body.logprobs is not None:
        logprobs = echo_logprobs(echo.token_ids, out.prompt_logprobs, body.logprobs, echo.first_token)
    return p.CompletionChoice(index=index, text=echo.text, logprobs=logprobs, finish_reason=reason)


def generated_choice(
    body: p.CompletionRequest,
    echo: Echo | None,
    out: RequestOutput,
    c: CompletionOutput,
    index: int,
    reason: str | None,
) -> p.CompletionChoice:
    """A whole choice: the echoed prompt, if any, then the generated text; logprobs likewise."""
    choice = p.CompletionChoice(index=index, text="") if echo is None else echo_choice(body, echo, out, index, reason)
    if body.logprobs is not None:
        generated = completion_logprobs(c, 0, body.logprobs, len(choice.text))
        choice.logprobs = generated if choice.logprobs is None else joined_logprobs(choice.logprobs, generated)
    choice.text += c.text
    choice.finish_reason = reason
    return choice


async def completion_events(
    model_name: str,
    body: p.CompletionRequest,
    request_id: str,
    prompts: list[Prompt],
    echoes: list[Echo] | None,
    streams: Sequence[OutputStream],
) -> AsyncIterator[str]:
    n, created = body.n or 1, int(time.time())
    progress = [ChoiceProgress() for _ in range(len(prompts) * n)]
    # An echoed prompt's outputs are held until its first chunk can go: with the prompt's logprobs
    # (which come with the first output after the prefill), or, echo_only, at the request's end.
    held: list[DeltaAccumulator | None] = [DeltaAccumulator() for _ in prompts] if echoes else [None] * len(prompts)
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
    param = constraint_param(body)

    def chunk(choices: list[p.CompletionChoice], usage_info: p.UsageInfo | None = None) -> str:
        return sse(
            p.CompletionResponse(id=request_id, created=created, model=model_name, choices=choices, usage=usage_info)
        )

    try:
        num_output_tokens = 0
        async for i, out in merged(streams):
            if (accumulated := held[i]) is not None:
                accumulated.add(out)
                if echo_only(body):
                    ready = out.finished
                else:
                    ready = out.finished or body.logprobs is None or out.prompt_logprobs is not None
                if not ready:
                    continue
                out, held[i] = accumulated.result(), None
                assert echoes is not None, "held outputs wait for their echoed prompt"
                for c in out.outputs:
                    reason = None
                    if echo_only(body):
                        finish_reason(out, c, param)  # raises for a request that was aborted or failed
                        reason = "length"
                    yield chunk([echo_choice(body, echoes[i], out, i * n + c.index, reason)])
                    progress[i * n + c.index].text_offset = len(echoes[i].text)
                if echo_only(body):
                    continue
            for update in choice_updates(out, progress, i * n, param):
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
