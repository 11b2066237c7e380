"""The OpenAI-compatible HTTP API over an AsyncEngine: build_app(engine, args) -> FastAPI.

A request is validated completely (types, ranges, context length, model name) before anything
reaches the engine, and waits until the engine has accepted it before the response starts, so
every refusal is a plain JSON error and never a half-sent stream.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import tachyllm
from tachyllm.errors import ConfigError, RequestError
from tachyllm.outputs import CompletionOutput, Logprob, RequestOutput
from tachyllm.sampling_params import SamplingParams
from tachyllm.server import protocol as p
from tachyllm.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from tachyllm.server.metrics import ServerMetrics

logger = logging.getLogger("tachyllm.server")

T = TypeVar("T", bound=BaseModel)

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# What a union-typed field accepts, for one readable message instead of one per alternative.
UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_dead(engine: AsyncEngine, e: EngineDeadError) -> APIError:
    if engine.error is not None:  # the engine failed: our fault
        return APIError(500, str(e), type="internal_error", code="engine_failed")
    return APIError(503, str(e), type="service_unavailable_error", code="shutting_down")


def request_aborted() -> APIError:
    # Clients never see their own aborts (they hung up); this abort came from a server shutdown.
    return APIError(
        503, "the request was aborted: the server is shutting down", "service_unavailable_error", code="aborted"
    )


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


@dataclass
class ServerState:
    engine: AsyncEngine
    served_names: list[str]
    api_key: str | None
    max_queue_len: int | None
    metrics: ServerMetrics
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

    def check_capacity(self) -> None:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down",
                "service_unavailable_error",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        if self.max_queue_len is not None and (waiting := self.engine.num_waiting) >= self.max_queue_len:
            raise APIError(
                503,
                f"the server is busy: {waiting} requests are waiting (max_queue_len {self.max_queue_len}); retry later",
                "service_unavailable_error",
                code="queue_full",
                headers={"Retry-After": "1"},
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
    related = [err["loc"] for err in errors if err["loc"][:1] == first["loc"][:1]]
    common = related[0]
    for loc in related[1:]:
        k = 0
        while k < min(len(common), len(loc)) and common[k] == loc[k]:
            k += 1
        common = common[:k]
    if len(related) > 1 and common and common[-1] in UNION_HINTS:
        path = loc_path(common)
        return bad_request(f"{path} must be {UNION_HINTS[common[-1]]}", param=path)
    path = loc_path(first["loc"])
    got = "" if first["type"] == "missing" else f" (got {repr(first['input'])[:100]})"
    return bad_request(f"{path}: {first['msg']}{got}", param=path)


def loc_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def reject_unsupported(body: p.SamplingFields) -> None:
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
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


def completion_prompts(engine: AsyncEngine, prompt: str | list) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    else:
        items = prompt
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(engine.tokenizer.encode(item) if item else [], item))
        else:
            if any(t >= engine.vocab_size for t in item):
                raise bad_request(
                    f"prompt token ids must be below the vocabulary size {engine.vocab_size}", param="prompt"
                )
            prompts.append(Prompt(list(item), None))
        if not prompts[-1].token_ids:
            raise bad_request("prompt must not be empty", param="prompt")
    return prompts


def chat_token_ids(engine: AsyncEngine, messages: list[p.ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    conversation = []
    for i, m in enumerate(messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            raise bad_request(
                f"role {m.role!r} is not supported; use one of {', '.join(CHAT_ROLES)}", param=f"messages[{i}].role"
            )
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"only text content parts are supported, got type {part.type!r}",
                        param=f"messages[{i}].content[{j}]",
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
    try:
        text = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    except (RequestError, ConfigError) as e:
        raise bad_request(str(e), param="messages") from None
    # The template spells out its special tokens; adding a BOS again would double it.
    return engine.tokenizer.encode(text, add_special_tokens=False)


def resolve_max_tokens(
    engine: AsyncEngine, requested: int | None, prompt_len: int, prompt_param: str, max_param: str
) -> int:
    """The request's max_tokens; by default whatever room the context leaves, as vLLM does."""
    limit = min(engine.max_model_len, engine.kv_cache_tokens)  # a request must also fit the KV cache
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


def sampling_params(body: p.SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
    """Admits one engine request per prompt, all or none."""
    state.check_capacity()
    results = await asyncio.gather(
        *(
            state.engine.add_request(f"{base_id}-{i}", pr.token_ids, sp)
            for i, (pr, sp) in enumerate(zip(prompts, params))
        ),
        return_exceptions=True,
    )
    streams = [r for r in results if isinstance(r, RequestStream)]
    failures = [r for r in results if not isinstance(r, RequestStream)]
    if failures:
        for stream in streams:
            stream.close()
        error = failures[0]
        if isinstance(error, RequestError):
            raise bad_request(str(error), param=prompt_param)
        raise error
    return streams


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


def finish_reason(c: CompletionOutput) -> str | None:
    if c.finish_reason == "abort":
        raise request_aborted()
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
    state = ServerState(engine, served_names, args.api_key, args.max_queue_len, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    # No generated docs: the endpoints parse their own bodies, and the docs would sit outside --api-key.
    app = FastAPI(
        title="tachyllm",
        version=tachyllm.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
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

    # -- open endpoints: probes and monitoring --------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return Response(status_code=500)
        return Response(status_code=503 if state.draining else 200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tachyllm.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(engine.snapshot), media_type=CONTENT_TYPE_LATEST)

    # -- the API --------------------------------------------------------------------------------
    api = APIRouter(dependencies=[Depends(state.authorize)])

    @api.get("/v1/models")
    async def models() -> Response:
        cards = [
            p.ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len) for name in served_names
        ]
        return json_response(p.ModelList(data=cards))

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, p.CompletionRequest)
        state.check_model(body.model)
        reject_unsupported(body)
        prompts = completion_prompts(engine, body.prompt)
        params = [
            sampling_params(
                body,
                resolve_max_tokens(engine, body.max_tokens, len(pr.token_ids), "prompt", "max_tokens"),
                body.logprobs,
            )
            for pr in prompts
        ]
        if body.echo:
            for pr in prompts:
                if pr.text is None:
                    pr.text = engine.tokenizer.decode(pr.token_ids, skip_special_tokens=False)
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
                choices.append(
                    p.CompletionChoice(
                        index=i * n + c.index, text=prefix + c.text, logprobs=logprobs, finish_reason=finish_reason(c)
                    )
                )
                num_output_tokens += len(c.token_ids)
        return json_response(
            p.CompletionResponse(
                id=request_id, model=state.model_name, choices=choices, usage=usage(prompts, num_output_tokens)
            )
        )

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, p.ChatCompletionRequest)
        state.check_model(body.model)
        reject_unsupported(body)
        prompt = Prompt(chat_token_ids(engine, body.messages), None)
        requested, max_param = body.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, max_param = body.max_tokens, "max_tokens"
        max_tokens = resolve_max_tokens(engine, requested, len(prompt.token_ids), "messages", max_param)
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling_params(body, max_tokens, top_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await start_requests(state, request_id, [prompt], [params], "messages")
        if body.stream:
            return event_stream(stream_errors(engine, chat_events(state, body, request_id, prompt, streams)))
        finals = await final_outputs(request, streams)
        if finals is None:
            return Response(status_code=499)
        choices = [
            p.ChatChoice(
                index=c.index,
                message=p.AssistantMessage(content=c.text),
                logprobs=None if top_logprobs is None else chat_logprobs(c, 0, top_logprobs),
                finish_reason=finish_reason(c),
            )
            for c in finals[0].outputs
        ]
        num_output_tokens = sum(len(c.token_ids) for c in finals[0].outputs)
        return json_response(
            p.ChatCompletionResponse(
                id=request_id, model=state.model_name, choices=choices, usage=usage([prompt], num_output_tokens)
            )
        )

    @api.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, p.TokenizeRequest)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = chat_token_ids(engine, body.messages, body.add_generation_prompt)
        else:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = [engine.tokenizer.id_to_token(t) for t in ids] if body.return_token_strs else None
        return json_response(
            p.TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)
        )

    @api.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, p.DetokenizeRequest)
        state.check_model(body.model)
        if any(t >= engine.vocab_size for t in body.tokens):
            raise bad_request(f"token ids must be below the vocabulary size {engine.vocab_size}", param="tokens")
        return json_response(
            p.DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))
        )

    app.include_router(api)
    return app


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
                delta, reason = c.text[pg.text_len :], finish_reason(c)
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
                delta, reason = c.text[pg.text_len :], finish_reason(c)
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
