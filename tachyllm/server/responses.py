"""Response pieces: finish reasons, logprobs and usage in OpenAI's shapes; JSON bodies and server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from tachyllm.engine.input_processor import Prompt
from tachyllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from tachyllm.server import protocol as p
from tachyllm.server.async_engine import EngineDeadError
from tachyllm.server.errors import APIError, engine_dead, request_aborted, request_failed, request_rejected

if TYPE_CHECKING:
    from tachyllm.server.state import EngineClient


def finish_reason(out: RequestOutput, c: CompletionOutput, constraint_param: str) -> str | None:
    """The choice's OpenAI finish reason; raises for one that did not finish as it should, a 400 naming
    `constraint_param` (the field of the request's constraint) for a rejected one."""
    if c.finish_reason == "abort":
        raise request_aborted()
    if c.finish_reason == "rejected":
        raise request_rejected(out, constraint_param)
    if c.finish_reason == "error":
        raise request_failed(out)
    return c.finish_reason  # "stop" and "length" mean what OpenAI means by them


def top_entries(entry: dict[int, Logprob], n: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= n), key=lambda lp: lp.rank)


def top_texts(entry: dict[int, Logprob], n: int) -> dict[str, float]:
    """The legacy shape's top_logprobs: decoded text -> logprob; of tokens that print alike, the likeliest."""
    top: dict[str, float] = {}
    for lp in top_entries(entry, n):
        top.setdefault(lp.decoded_token, lp.logprob)
    return top


def completion_logprobs(c: CompletionOutput, start: int, top_n: int, text_offset: int) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = entry[token]
        out.tokens.append(chosen.decoded_token)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append(top_texts(entry, top_n))
        out.text_offset.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return out


def echo_logprobs(
    token_ids: list[int], entries: PromptLogprobs | None, top_n: int, first_token: str
) -> p.CompletionLogprobs:
    """An echoed prompt's logprobs in OpenAI's legacy shape: its first token (`first_token`, its text)
    has none (null), the others their logprob and top-N given the tokens before them."""
    out = p.CompletionLogprobs()
    offset = 0
    for token, entry in zip(token_ids, entries or []):
        text = first_token if entry is None else entry[token].decoded_token
        out.tokens.append(text)
        out.token_logprobs.append(None if entry is None else entry[token].logprob)
        out.top_logprobs.append(None if entry is None else top_texts(entry, top_n))
        out.text_offset.append(offset)
        offset += len(text)
    return out


def joined_logprobs(first: p.CompletionLogprobs, then: p.CompletionLogprobs) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(
        text_offset=first.text_offset + then.text_offset,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        tokens=first.tokens + then.tokens,
        top_logprobs=first.top_logprobs + then.top_logprobs,
    )


def prompt_logprobs(out: RequestOutput, top_n: int | None) -> p.PromptLogprobs | None:
    """vLLM's prompt_logprobs of a response: each entry's prompt token and its top_n alternatives
    (the engine may have computed more, for an echo's logprobs)."""
    if top_n is None or out.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            t: p.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in entry.items()
            if t == token or lp.rank <= top_n
        }
        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)
    ]


def chat_logprobs(c: CompletionOutput, start: int, top_n: int) -> p.ChatLogprobs:
    def top(lp: Logprob) -> p.TopLogprob:
        return p.TopLogprob(token=lp.decoded_token, logprob=lp.logprob, bytes=list(lp.decoded_token.encode()))

    content = []
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = top(entry[token])
        content.append(
            p.ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[top(lp) for lp in top_entries(entry, top_n)])
        )
    return p.ChatLogprobs(content=content)


def usage(prompts: list[Prompt], num_output_tokens: int) -> p.UsageInfo:
    num_prompt_tokens = sum(len(pr.token_ids) for pr in prompts)
    return p.UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_output_tokens,
        total_tokens=num_prompt_tokens + num_output_tokens,
    )


def json_object(fields: dict, **long_lists: list | None) -> str:
    """A JSON object of `fields` and long lists, written a slice at a time: a serializer holds the
    GIL until it is done (~0.1 s for a million ids, 0.3 ms for a slice of 4096), while between
    slices other threads, the event loop's and the engine's among them, get their turn."""
    parts = [json.dumps(fields)[:-1]]
    for name, items in long_lists.items():
        if items is None:
            parts.append(f', "{name}": null')
            continue
        step = 1 << 12
        slices = (json.dumps(items[i : i + step])[1:-1] for i in range(0, len(items), step))
        parts.append(f', "{name}": [' + ", ".join(slices) + "]")
    return "".join(parts) + "}"


def json_response(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status, headers, media_type="application/json")


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def stream_errors(engine: EngineClient, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Ends a stream that fails midway with an error event, the way OpenAI's clients expect."""
    try:
        async for event in events:
            yield event
    except (APIError, EngineDeadError) as e:
        error = e if isinstance(e, APIError) else engine_dead(e, engine.error is not None)
        yield sse(error.body)
        yield SSE_DONE
