"""The OpenAI-compatible HTTP API over an AsyncEngine: build_app(engine, args) -> FastAPI.

A request is validated completely (types, ranges, context length, model name) before anything
reaches the engine, and waits until the engine has accepted it before the response starts, so
every refusal is a plain JSON error and never a half-sent stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

import tachyllm
from tachyllm.errors import ConfigError, RequestError
from tachyllm.outputs import CompletionOutput, Logprob, RequestOutput
from tachyllm.sampling_params import SamplingParams
from tachyllm.server import protocol as p
from tachyllm.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from tachyllm.server.errors import APIError, bad_request
from tachyllm.server.guard import RequestGuard, default_allowed_hosts
from tachyllm.server.metrics import ServerMetrics
from tachyllm.server.openapi import ERROR_RESPONSES, openapi_document, route_doc

logger = logging.getLogger("tachyllm.server")

T = TypeVar("T", bound=BaseModel)

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# What a union-typed field accepts, for one readable message instead of one per alternative.
UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


def engine_dead(engine: AsyncEngine, e: EngineDeadError) -> APIError:
    # 503 either way: a failed engine makes the server exit, so a supervisor restarts it.
    code = "engine_failed" if engine.error is not None else "shutting_down"
    return APIError(503, str(e), "service_unavailable_error", code=code)


def request_aborted() -> APIError:
    # Clients never see their own aborts (they hung up); this abort came from a server shutdown.
    return APIError(
        503, "the request was aborted: the server is shutting down", "service_unavailable_error", code="aborted"
    )


def request_failed(out: RequestOutput) -> APIError:
    message = out.error or "the engine failed while running this request"
    return APIError(500, message, "internal_error", code="engine_error")


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # as the client sent it; None for token ids


@dataclass
class ChoiceProgress:
    """How much of one choice a stream has sent."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token in the choice's text
    finished: bool = False


@dataclass(frozen=True)
class RequestLimits:
    """What one HTTP request may ask for (each breach is a 400 naming the field)."""

    max_n: int = 128  # OpenAI's own cap on n
    max_prompts: int = 256  # prompts in one completions request
    # Tokens one HTTP request may claim: prompts plus n x max_tokens, summed over its prompts.
    max_request_tokens: int = 1 << 20


@dataclass
class ServerState:
    engine: AsyncEngine
    served_names: list[str]
    api_key: str | None
    max_queue_len: int | None
    metrics: ServerMetrics
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Seconds a step may run before the engine counts as hung (0: never).
    iteration_timeout: float = 0.0
    draining: bool = False

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    async def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {', '.join(map(repr, self.served_names))}",
                param="model",
                code="model_not_found",
            )

    def check_not_draining(self) -> None:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down",
                "service_unavailable_error",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (it stopped, or its step hangs past the timeout); None if it can."""
        if not self.engine.is_running:
            return f"the engine stopped: {self.engine.error}" if self.engine.error else "the engine was shut down"
        busy = self.engine.busy_seconds()
        if self.iteration_timeout and busy > self.iteration_timeout:
            return (
                f"the engine's current iteration has run for {busy:.0f} s "
                f"(--engine-iteration-timeout {self.iteration_timeout:g})"
            )
        return None

    @property
    def context_limit(self) -> int:
        """Prompt and output tokens together: what the context and the KV cache both hold."""
        return min(self.engine.max_model_len, self.engine.kv_cache_tokens)

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuses, before tokenizing, a prompt whose length alone proves it cannot fit: no token
        spells more than max_token_chars characters."""
        per_token = self.engine.tokenizer.max_token_chars
        if num_chars > self.context_limit * per_token:
            raise bad_request(
                f"the prompt has {num_chars} characters, more than the {self.context_limit} tokens of this "
                f"server's context limit can hold (at most {per_token} characters per token); shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )

    def check_n(self, n: int | None) -> None:
        if (n or 1) > self.limits.max_n:
            raise bad_request(f"n must be at most {self.limits.max_n} on this server (--max-n), got {n}", param="n")

    def check_requested_tokens(self, prompts: list[Prompt], params: list[SamplingParams], max_param: str) -> None:
        requested = sum(len(pr.token_ids) + sp.n * sp.max_tokens for pr, sp in zip(prompts, params))
        if requested > self.limits.max_request_tokens:
            raise bad_request(
                f"this request asks for {requested} tokens (prompts plus n x {max_param}), more than this "
                f"server's limit of {self.limits.max_request_tokens} per request (--max-request-tokens); "
                f"lower n or {max_param}, or send fewer prompts",
                param=max_param,
            )

    async def drain(self, timeout: float) -> None:
        """Refuses new requests, waits up to `timeout` s for the admitted ones, then aborts the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if unfinished := self.engine.num_unfinished:
            logger.info("shutting down: waiting up to %.1f s for %d requests", timeout, unfinished)
        while self.engine.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if unfinished := self.engine.num_unfinished:
            logger.warning("shutdown timeout reached: aborting %d unfinished requests", unfinished)
            self.engine.abort_all()


# -- request parsing -------------------------------------------------------------------------------


async def parse_body(request: Request, model: type[T]) -> T:
    raw = await request.body()
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise invalid_body(e) from None


def invalid_body(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {first['msg']}", code="invalid_json")
    if not first["loc"]:
        return bad_request("the request body must be a JSON object")
    # A union-typed field reports one error per alternative, all under the field's location.
    related = [err for err in errors if err["loc"][:1] == first["loc"][:1]]
    common = related[0]["loc"]
    for err in related[1:]:
        k = 0
        while k < min(len(common), len(err["loc"])) and common[k] == err["loc"][k]:
            k += 1
        common = common[:k]
    if len(related) > 1 and common and common[-1] in UNION_HINTS:
        path = loc_path(common)
        # The value had the type of one alternative and broke its constraint (too long, < 0, ...):
        # that one says what is wrong (its location, less the alternative's name).
        broken = [err for err in related if not err["type"].endswith("_type")]
        if len(broken) == 1:
            err = broken[0]
            where = loc_path(common + err["loc"][len(common) + 1 :])
            return bad_request(f"{where}: {err['msg']}{got(err)}", param=path)
        return bad_request(f"{path} must be {UNION_HINTS[common[-1]]}", param=path)
    path = loc_path(first["loc"])
    return bad_request(f"{path}: {first['msg']}{got(first)}", param=path)


def got(err: dict) -> str:
    return "" if err["type"] == "missing" else f" (got {repr(err['input'])[:100]})"


def loc_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def reject_unsupported(body: p.SamplingFields) -> None:
    if isinstance(body, p.CompletionRequest):
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise bad_request("best_of other than n is not supported", param="best_of")
        if body.echo and body.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", param="echo")
    else:
        if body.tools:
            raise bad_request("tools are not supported", param="tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported", param="response_format")
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) -> a bias in [-100, 100]. The
    engine checks the ids against the vocabulary, as every other token id a request names."""
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]{1,10}", key):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:20]!r}", param="logit_bias")
        parsed[int(key)] = value
    return parsed


async def completion_prompts(state: ServerState, prompt: str | list) -> list[Prompt]:
    engine = state.engine
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    else:
        items = prompt
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(items) > state.limits.max_prompts:
        raise bad_request(
            f"at most {state.limits.max_prompts} prompts per request on this server (--max-prompts-per-request), "
            f"got {len(items)}",
            param="prompt",
        )
    texts = [item for item in items if isinstance(item, str)]
    for text in texts:
        state.check_prompt_chars(len(text), "prompt")
    for item in items:
        if not isinstance(item, str) and any(t >= engine.vocab_size for t in item):
            raise bad_request(f"prompt token ids must be below the vocabulary size {engine.vocab_size}", param="prompt")
    # Off the event loop: a long prompt takes the tokenizer a while (~0.4 s per MiB).
    encoded = iter(await asyncio.to_thread(lambda: [engine.tokenizer.encode(t) if t else [] for t in texts]))
    prompts = [Prompt(next(encoded), item) if isinstance(item, str) else Prompt(list(item), None) for item in items]
    if any(not pr.token_ids for pr in prompts):
        raise bad_request("prompt must not be empty", param="prompt")
    return prompts


def chat_conversation(messages: list[p.ChatMessage]) -> list[dict[str, str]]:
    conversation = []
    for i, m in enumerate(messages):
        role = CHAT_ROLES[m.role]
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise bad_request(
                        f"only text content parts are supported, got type {part.type!r}",
                        param=f"messages[{i}].content[{j}]",
                    )
                if part.text is None:
                    raise bad_request(
                        "a content part of type 'text' needs a 'text' field", param=f"messages[{i}].content[{j}].text"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        elif m.content is None:
            if role != "assistant":
                raise bad_request("content is required", param=f"messages[{i}].content")
            content = ""
        else:
            content = m.content
        conversation.append({"role": role, "content": content})
    return conversation


async def chat_token_ids(
    state: ServerState, messages: list[p.ChatMessage], add_generation_prompt: bool = True, check_length: bool = True
) -> list[int]:
    conversation = chat_conversation(messages)
    if check_length:
        state.check_prompt_chars(sum(len(m["content"]) for m in conversation), "messages")
    tokenizer = state.engine.tokenizer

    def render_and_encode() -> list[int]:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        # The template spells out its special tokens; adding a BOS again would double it.
        return tokenizer.encode(text, add_special_tokens=False)

    try:
        return await asyncio.to_thread(render_and_encode)  # off the event loop, as for completions
    except (RequestError, ConfigError) as e:
        raise bad_request(str(e), param="messages") from None


def resolve_max_tokens(
    state: ServerState, requested: int | None, prompt_len: int, prompt_param: str, max_param: str
) -> int:
    """The request's max_tokens; by default whatever room the context leaves, as vLLM does."""
    limit = state.context_limit
    if prompt_len >= limit:
        raise bad_request(
            f"the prompt has {prompt_len} tokens but this server's context limit is {limit} tokens "
            "(prompt and output together); shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise bad_request(
            f"this server's context limit is {limit} tokens, but {prompt_len + requested} were requested "
            f"({prompt_len} in the prompt, {requested} for the output); lower {max_param} or shorten the prompt",
            param=max_param,
            code="context_length_exceeded",
        )
    return requested


def sampling_params(
    body: p.SamplingFields, max_tokens: int, logprobs: int | None, bias: dict[int, float] | None
) -> SamplingParams:
    options = {
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        # vLLM reads top_k 0 as "disabled", like -1.
        "top_k": -1 if body.top_k == 0 else body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.seed,
        "min_tokens": body.min_tokens,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "logprobs": logprobs,
        "logit_bias": bias,
    }
    try:
        # Unset (None) fields take SamplingParams' defaults, which are OpenAI's.
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=body.ignore_eos, **{k: v for k, v in options.items() if v is not None}
        )
    except ValueError as e:  # cross-field checks (e.g. min_tokens > max_tokens); messages start with the field
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None


# -- running requests ----------------------------------------------------------------------------


async def start_requests(
    state: ServerState, base_id: str, prompts: list[Prompt], params: list[SamplingParams], prompt_param: str
) -> list[RequestStream]:
    """Admits one engine request per prompt, all or none, while the queue has room for them all."""
    state.check_not_draining()
    limit = state.max_queue_len
    if limit is not None and len(prompts) > limit:
        raise bad_request(
            f"{len(prompts)} prompts can never wait at once on this server (--max-queue-len {limit})",
            param=prompt_param,
        )
    requests = [(f"{base_id}-{i}", pr.token_ids, sp) for i, (pr, sp) in enumerate(zip(prompts, params))]
    try:
        return await state.engine.add_requests(requests, max_queued=limit)
    except QueueFullError as e:
        raise APIError(
            503,
            f"the server is busy: {e.num_queued} requests are waiting to start (max_queue_len {e.limit}); retry later",
            "service_unavailable_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from None
    except RequestError as e:
        raise bad_request(str(e), param=e.param or prompt_param) from None


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as they come, tagged with each request's position.
    Leaving early (client gone, error) aborts every unfinished request."""
    tasks: list[asyncio.Task] = []
    try:
        if len(streams) == 1:  # the common case needs no helper tasks
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))
                return
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def final_outputs(request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """Each request's final output, in order; None if the client hung up first (all are then aborted)."""

    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput] = [None] * len(streams)  # type: ignore[list-item]
        async for i, out in merged(streams):
            finals[i] = out
        return finals

    async def hang_up() -> None:
        # Once the body is read, receive() returns only when the connection goes away.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # unwinds merged(), which aborts the requests
    return work.result() if work.done() and not work.cancelled() else None


def finish_reason(out: RequestOutput, c: CompletionOutput) -> str | None:
    if c.finish_reason == "abort":
        raise request_aborted()
    if c.finish_reason == "error":
        raise request_failed(out)
    return c.finish_reason  # "stop" and "length" mean what OpenAI means by them


def top_entries(entry: dict[int, Logprob], n: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= n), key=lambda lp: lp.rank)


def completion_logprobs(c: CompletionOutput, start: int, top_n: int, text_offset: int) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    for token, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        chosen = entry[token]
        out.tokens.append(chosen.decoded_token)
        out.token_logprobs.append(chosen.logprob)
        out.top_logprobs.append({lp.decoded_token: lp.logprob for lp in top_entries(entry, top_n)})
        out.text_offset.append(text_offset)
        text_offset += len(chosen.decoded_token)
    return out


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
    GIL until it is done (~0.1 s for a million ids), while between slices other threads, the event
    loop's among them, get their turn."""
    parts = [json.dumps(fields)[:-1]]
    for name, items in long_lists.items():
        if items is None:
            parts.append(f', "{name}": null')
            continue
        step = 1 << 14
        slices = (json.dumps(items[i : i + step])[1:-1] for i in range(0, len(items), step))
        parts.append(f', "{name}": [' + ", ".join(slices) + "]")
    return "".join(parts) + "}"


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def json_response(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), status, headers, media_type="application/json")


async def stream_errors(engine: AsyncEngine, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Ends a stream that fails midway with an error event, the way OpenAI's clients expect."""
    try:
        async for event in events:
            yield event
    except (APIError, EngineDeadError) as e:
        error = e if isinstance(e, APIError) else engine_dead(engine, e)
        yield sse(error.body)
        yield SSE_DONE


# -- the app -------------------------------------------------------------------------------------


def build_app(engine: AsyncEngine, args: argparse.Namespace) -> FastAPI:
    served_names = list(args.served_model_name or [engine.model_name])
    metrics = ServerMetrics(served_names[0])
    engine.add_output_listener(metrics.observe)
    limits = RequestLimits(args.max_n, args.max_prompts_per_request, args.max_request_tokens)
    state = ServerState(
        engine, served_names, args.api_key, args.max_queue_len, metrics, limits, args.engine_iteration_timeout
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            # A hung step never returns: give up on it after a while (its thread is a daemon).
            await asyncio.to_thread(engine.shutdown, 10.0)

    # The OpenAPI document is open like /health (it describes the API, it does not use it);
    # no interactive docs pages, which would load scripts from elsewhere.
    app = FastAPI(
        title="tachyllm",
        version=tachyllm.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        responses={421: ERROR_RESPONSES[421]},  # the Host check answers it before any route
    )
    app.state.server = state

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> Response:
        return json_response(e.body, e.status, e.headers)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, e: EngineDeadError) -> Response:
        error = engine_dead(engine, e)
        return json_response(error.body, error.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> Response:
        error = APIError(
            e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"
        )
        return json_response(error.body, error.status, e.headers)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, e: Exception) -> Response:
        error = APIError(500, f"internal server error ({type(e).__name__}: {e})", "internal_error")
        return json_response(error.body, error.status)

    # -- open endpoints: probes, monitoring, the API's description --------------------------------
    @app.get("/health", response_class=Response, responses={200: {"description": "serving"}, 503: ERROR_RESPONSES[503]})
    async def health() -> Response:
        """200 while the engine serves; 503 while draining, or once the engine stopped or hangs."""
        if problem := state.health_problem():
            error = APIError(503, problem, "service_unavailable_error", code="engine_unhealthy")
            return json_response(error.body, error.status)
        state.check_not_draining()  # 503 while draining
        return Response(status_code=200)

    @app.get("/version", response_model=p.VersionResponse)
    async def version() -> Response:
        return json_response(p.VersionResponse(version=tachyllm.__version__))

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics() -> Response:
        """Prometheus metrics in the text exposition format."""
        return Response(metrics.render(engine.snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        document = openapi_document(app, engine.vocab_size, limits.max_n)
        return Response(json.dumps(document), media_type="application/json")

    # -- the API --------------------------------------------------------------------------------
    api = APIRouter(dependencies=[Depends(state.authorize)], responses={401: ERROR_RESPONSES[401]})

    @api.get("/v1/models", response_model=p.ModelList)
    async def models() -> Response:
        return json_response(p.ModelList(data=[model_card(name) for name in served_names]))

    @api.get("/v1/models/{model_id:path}", response_model=p.ModelCard, responses={404: ERROR_RESPONSES[404]})
    async def model(model_id: str) -> Response:
        state.check_model(model_id)
        return json_response(model_card(model_id))

    def model_card(name: str) -> p.ModelCard:
        return p.ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)

    @api.post("/v1/completions", **route_doc(p.CompletionRequest, p.CompletionResponse, generates=True))
    async def completions(request: Request) -> Response:
        body = await parse_body(request, p.CompletionRequest)
        state.check_model(body.model)
        reject_unsupported(body)
        state.check_n(body.n)
        bias = logit_bias(body.logit_bias)
        prompts = await completion_prompts(state, body.prompt)
        params = [
            sampling_params(
                body,
                resolve_max_tokens(state, body.max_tokens, len(pr.token_ids), "prompt", "max_tokens"),
                body.logprobs,
                bias,
            )
            for pr in prompts
        ]
        state.check_requested_tokens(prompts, params, "max_tokens")
        if body.echo and (missing := [pr for pr in prompts if pr.text is None]):
            texts = await asyncio.to_thread(
                lambda: [engine.tokenizer.decode(pr.token_ids, skip_special_tokens=False) for pr in missing]
            )
            for pr, text in zip(missing, texts):
                pr.text = text
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await start_requests(state, request_id, prompts, params, "prompt")
        if body.stream:
            return event_stream(stream_errors(engine, completion_events(state, body, request_id, prompts, streams)))
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
            p.CompletionResponse(
                id=request_id, model=state.model_name, choices=choices, usage=usage(prompts, num_output_tokens)
            )
        )

    @api.post("/v1/chat/completions", **route_doc(p.ChatCompletionRequest, p.ChatCompletionResponse, generates=True))
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, p.ChatCompletionRequest)
        state.check_model(body.model)
        reject_unsupported(body)
        state.check_n(body.n)
        bias = logit_bias(body.logit_bias)
        prompt = Prompt(await chat_token_ids(state, body.messages), None)
        requested, max_param = body.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, max_param = body.max_tokens, "max_tokens"
        max_tokens = resolve_max_tokens(state, requested, len(prompt.token_ids), "messages", max_param)
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, top_logprobs, bias)
        state.check_requested_tokens([prompt], [params], max_param)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await start_requests(state, request_id, [prompt], [params], "messages")
        if body.stream:
            return event_stream(stream_errors(engine, chat_events(state, body, request_id, prompt, streams)))
        finals = await final_outputs(request, streams)
        if finals is None:
            return Response(status_code=499)
        out = finals[0]
        choices = [
            p.ChatChoice(
                index=c.index,
                message=p.AssistantMessage(content=c.text),
                logprobs=None if top_logprobs is None else chat_logprobs(c, 0, top_logprobs),
                finish_reason=finish_reason(out, c),
            )
            for c in out.outputs
        ]
        num_output_tokens = sum(len(c.token_ids) for c in out.outputs)
        return json_response(
            p.ChatCompletionResponse(
                id=request_id, model=state.model_name, choices=choices, usage=usage([prompt], num_output_tokens)
            )
        )

    @api.post("/tokenize", **route_doc(p.TokenizeRequest, p.TokenizeResponse))
    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, p.TokenizeRequest)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        tokenizer = engine.tokenizer
        if body.messages is not None:
            ids = await chat_token_ids(state, body.messages, body.add_generation_prompt, check_length=False)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)

        def respond() -> Response:
            strs = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
            head = {"count": len(ids), "max_model_len": engine.max_model_len}
            return Response(json_object(head, tokens=ids, token_strs=strs), media_type="application/json")

        return await asyncio.to_thread(respond)

    @api.post("/detokenize", **route_doc(p.DetokenizeRequest, p.DetokenizeResponse))
    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, p.DetokenizeRequest)
        state.check_model(body.model)
        if any(t >= engine.vocab_size for t in body.tokens):
            raise bad_request(f"token ids must be below the vocabulary size {engine.vocab_size}", param="tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, body.tokens, False)
        return json_response(p.DetokenizeResponse(prompt=text))

    app.include_router(api)
    # Refusals (host, content type, size) happen before routing, for every route; CORS, when on,
    # is added last and so wraps them: an allowed page can read a refusal too.
    app.add_middleware(RequestGuard, max_body_bytes=args.max_request_body_bytes, allowed_hosts=allowed_hosts(args))
    if args.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    return app


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    return args.allowed_hosts if args.allowed_hosts else default_allowed_hosts(args.host)


async def completion_events(
    state: ServerState, body: p.CompletionRequest, request_id: str, prompts: list[Prompt], streams: list[RequestStream]
) -> AsyncIterator[str]:
    n, created = body.n or 1, int(time.time())
    progress = [ChoiceProgress() for _ in range(len(prompts) * n)]

    def chunk(choices: list[p.CompletionChoice], usage_info: p.UsageInfo | None = None) -> str:
        return sse(
            p.CompletionResponse(
                id=request_id, created=created, model=state.model_name, choices=choices, usage=usage_info
            )
        )

    try:
        if body.echo:
            for i, pr in enumerate(prompts):
                for j in range(n):
                    progress[i * n + j].text_offset = len(pr.text)
                    yield chunk([p.CompletionChoice(index=i * n + j, text=pr.text)])
        num_output_tokens = 0
        async for i, out in merged(streams):
            for c in out.outputs:
                index = i * n + c.index
                pg = progress[index]
                delta, reason = c.text[pg.text_len :], finish_reason(out, c)
                if pg.finished or (not delta and reason is None):
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(c, pg.num_tokens, body.logprobs, pg.text_offset)
                    pg.text_offset += sum(map(len, logprobs.tokens))
                pg.text_len, pg.num_tokens, pg.finished = len(c.text), len(c.token_ids), reason is not None
                if pg.finished:
                    num_output_tokens += len(c.token_ids)
                yield chunk([p.CompletionChoice(index=index, text=delta, logprobs=logprobs, finish_reason=reason)])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage(prompts, num_output_tokens))
        yield SSE_DONE
    finally:
        for stream in streams:  # merged() closes them too, but a client may leave before it starts
            stream.close()


async def chat_events(
    state: ServerState, body: p.ChatCompletionRequest, request_id: str, prompt: Prompt, streams: list[RequestStream]
) -> AsyncIterator[str]:
    n, created = body.n or 1, int(time.time())
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    progress = [ChoiceProgress() for _ in range(n)]

    def chunk(choices: list[p.ChatChunkChoice], usage_info: p.UsageInfo | None = None) -> str:
        return sse(
            p.ChatCompletionChunk(
                id=request_id, created=created, model=state.model_name, choices=choices, usage=usage_info
            )
        )

    try:
        for index in range(n):
            yield chunk([p.ChatChunkChoice(index=index, delta=p.ChatDelta(role="assistant", content=""))])
        num_output_tokens = 0
        async for _, out in merged(streams):
            for c in out.outputs:
                pg = progress[c.index]
                delta, reason = c.text[pg.text_len :], finish_reason(out, c)
                if pg.finished or (not delta and reason is None):
                    continue
                logprobs = None if top_logprobs is None else chat_logprobs(c, pg.num_tokens, top_logprobs)
                pg.text_len, pg.num_tokens, pg.finished = len(c.text), len(c.token_ids), reason is not None
                if pg.finished:
                    num_output_tokens += len(c.token_ids)
                choice = p.ChatChunkChoice(
                    index=c.index, delta=p.ChatDelta(content=delta or None), logprobs=logprobs, finish_reason=reason
                )
                yield chunk([choice])
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], usage([prompt], num_output_tokens))
        yield SSE_DONE
    finally:
        for stream in streams:
            stream.close()
