"""ServerState: what every route shares (the served models and their engines, the API key, the limits
of one request) and the server's own checks (HTTP policy; the engine's InputProcessor checks the rest)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from fastapi import Request

from tachyllm.engine.input_processor import InputProcessor, ProcessedRequest, Prompt
from tachyllm.loading import Tokenizer
from tachyllm.lora.request import LoRARequest
from tachyllm.model_config import ModelConfig
from tachyllm.sampling_params import SamplingParams
from tachyllm.server.async_engine import EngineDeadError, OutputStream, RequestParams
from tachyllm.server.errors import APIError, bad_request, engine_dead
from tachyllm.server.metrics import merge_expositions
from tachyllm.server.tools import tool_format

logger = logging.getLogger("tachyllm.server")


# The routes that serve each kind of model (ServedModel.task).
TASK_ENDPOINTS = {
    "generate": ["/v1/completions", "/v1/chat/completions", "/v1/responses"],
    "embed": ["/v1/embeddings", "/v1/score", "/v1/rerank"],
    "score": ["/v1/score", "/v1/rerank"],
}
TASK_NAMES = {"generate": "a text generation model", "embed": "an embedding model", "score": "a cross-encoder"}


@dataclass(frozen=True)
class RequestLimits:
    """What one HTTP request may ask for (each breach is a 400 naming the field)."""

    max_n: int = 128  # OpenAI's own cap on n
    max_prompts: int = 256  # prompts in one completions request
    # Tokens one HTTP request may claim: prompts plus n x max_tokens, summed over its prompts.
    max_request_tokens: int = 1 << 20
    # Inputs one pooling request may carry: embeddings' inputs, rerank's documents, score's pairs.
    max_pooling_inputs: int = 2048


class EngineClient(Protocol):
    """What the routes use of an engine: an AsyncEngine in this process, or ray_serve's RemoteEngine
    over a deployment's replicas. Its add_requests returns streams that iterate like RequestStream
    (outputs, then the end or an exception) and close() like it: OutputStreams."""

    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    input_processor: InputProcessor
    # SamplingParams values for fields a request leaves unset (the model's generation config).
    default_sampling_params: dict[str, Any]
    error: BaseException | None
    # What the model is served for (docs/pooling.md): "generate", or "pooling" with the tasks it serves
    # ({"embed"}, or {"classify", "score"} for a cross-encoder), its embeddings' size and whether a request
    # may truncate them (`dimensions`).
    runner_type: Literal["generate", "pooling"]
    pooling_tasks: frozenset[str]
    embedding_dim: int | None
    is_matryoshka: bool

    async def add_requests(
        self,
        requests: list[tuple[str, ProcessedRequest, RequestParams]],
        max_queued: int | None = None,
    ) -> Sequence[OutputStream]: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def num_unfinished(self) -> int: ...

    def busy_seconds(self) -> float: ...

    def abort_all(self) -> None: ...

    def abandon(self, reason: str, failed: bool) -> None: ...

    def shutdown(self, timeout: float | None = None) -> None: ...


# Prometheus expositions to serve on /metrics, each with the labels to add to its samples.
MetricsSource = Callable[[], Awaitable[list[tuple[dict[str, str], bytes]]]]


@dataclass
class ServedModel:
    """One model the server serves: the names clients may ask for (the first is reported in responses)
    and the engine that runs it."""

    names: list[str]
    engine: EngineClient
    tool_call_parser: str | None = None  # --tool-call-parser; None: the chat template's format
    # A LoRA adapter served as a model (--lora-modules): the adapter every request runs with, on the
    # engine of its parent, the model /v1/models names as such.
    lora: LoRARequest | None = None
    parent: str | None = None

    @property
    def tool_format(self) -> str:
        """How this model writes tool calls (tools.py): --tool-call-parser, else its chat template's."""
        return tool_format(self.engine.tokenizer.chat_template, self.tool_call_parser)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def task(self) -> Literal["generate", "embed", "score"]:
        """What the model is for: generating text, embedding inputs, or scoring pairs (a cross-encoder)."""
        engine = self.engine
        if engine.runner_type == "generate":
            return "generate"
        return "score" if "score" in engine.pooling_tasks else "embed"

    def check_task(self, task: Literal["generate", "embed", "score"], route: str) -> None:
        """Refuses (400) a request for `route` to a model not for it: generation to a pooling model,
        embeddings to a generation model or a cross-encoder, score / rerank to a generation model (an
        embedding model scores by the cosine similarity of its embeddings)."""
        served = self.task
        if served == task or (task == "score" and served == "embed"):
            return
        raise bad_request(
            f"the model {self.name!r} is {TASK_NAMES[served]}: it serves {', '.join(TASK_ENDPOINTS[served])}, "
            f"not {route}",
            param="model",
        )

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """Values of the sampling fields a request leaves unset: the model's generation config
        (--generation-config), else none (SamplingParams' own defaults)."""
        return self.engine.default_sampling_params

    @property
    def processor(self) -> InputProcessor:
        return self.engine.input_processor

    @property
    def context_limit(self) -> int:
        """Prompt and output tokens together: what the context and the KV cache both hold."""
        return self.processor.limits.context_limit

    @property
    def prompt_token_limit(self) -> int:
        """The most tokens one prompt may have: a pooling model's input limit (an encoder keeps no KV
        cache, so its positions and a step's budget bound its inputs, not the cache), else the context."""
        pooling = self.processor.pooling
        return self.context_limit if pooling is None else pooling.max_input_tokens

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuses, before tokenizing, a prompt whose length alone proves it cannot fit: no token
        spells more than max_token_chars characters."""
        per_token = self.engine.tokenizer.max_token_chars
        limit = self.prompt_token_limit
        if num_chars > limit * per_token:
            raise bad_request(
                f"the prompt has {num_chars} characters, more than the {limit} tokens of this "
                f"server's context limit can hold (at most {per_token} characters per token); shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )


@dataclass
class RuntimeLoRA:
    """What /v1/load_lora_adapter needs (--allow-runtime-lora-updating): the model adapters are loaded
    on, their rank limit, and the id the next one gets (each load a new one, so that an adapter loaded
    again under its name is read anew)."""

    base: ServedModel
    model_config: ModelConfig  # the base model's, which an adapter is checked against
    max_lora_rank: int
    next_id: int = 1


@dataclass
class ServerState:
    models: list[ServedModel]
    api_key: str | None
    max_queue_len: int | None
    metrics_sources: list[MetricsSource]
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Seconds a step may run before the engine counts as hung (0: never).
    iteration_timeout: float = 0.0
    draining: bool = False
    runtime_lora: RuntimeLoRA | None = None  # with --allow-runtime-lora-updating

    @property
    def served_names(self) -> list[str]:
        return [name for m in self.models for name in m.names]

    @property
    def engines(self) -> list[EngineClient]:
        """Each engine once (a LoRA adapter's model shares its parent's)."""
        return list({id(m.engine): m.engine for m in self.models}.values())

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

    def model(self, name: str | None) -> ServedModel:
        """The model a request names; a request that names none gets the first one."""
        if name is None:
            return self.models[0]
        for m in self.models:
            if name in m.names:
                return m
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {', '.join(map(repr, self.served_names))}",
            param="model",
            code="model_not_found",
        )

    def check_not_draining(self) -> None:
        if self.draining:
            if problem := self.health_problem():  # the server exits because an engine failed: say so
                raise engine_dead(EngineDeadError(problem), failed=True)
            raise APIError(
                503,
                "the server is shutting down",
                "service_unavailable_error",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )

    def health_problem(self) -> str | None:
        """Why an engine cannot serve (it stopped, or its step hangs past the timeout); None if all can."""
        for m in self.models:
            if problem := engine_problem(m.engine, self.iteration_timeout):
                return problem if len(self.models) == 1 else f"model {m.name!r}: {problem}"
        return None

    async def metrics_text(self) -> bytes:
        parts = [part for source in self.metrics_sources for part in await source()]
        return merge_expositions(parts)

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

    def check_tokens_returned(self, num_tokens: int, param: str, at_least: bool = False) -> None:
        """/tokenize answers at most --max-request-tokens ids (its answer would otherwise grow with the body)."""
        if num_tokens > self.limits.max_request_tokens:
            count = f"at least {num_tokens}" if at_least else str(num_tokens)
            raise bad_request(
                f"the {param} has {count} tokens, more than this server's limit of "
                f"{self.limits.max_request_tokens} per request (--max-request-tokens)",
                param=param,
            )

    async def drain(self, timeout: float) -> None:
        """Refuses new requests, waits up to `timeout` s for the admitted ones, then aborts the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if unfinished := self.num_unfinished:
            logger.info("shutting down: waiting up to %.1f s for %d requests", timeout, unfinished)
        while self.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if unfinished := self.num_unfinished:
            logger.warning("shutdown timeout reached: aborting %d unfinished requests", unfinished)
            for engine in self.engines:
                engine.abort_all()

    @property
    def num_unfinished(self) -> int:
        return sum(engine.num_unfinished for engine in self.engines)


def engine_problem(engine: EngineClient, iteration_timeout: float) -> str | None:
    """Why an engine cannot serve: its loop stopped, or its current iteration has run past
    `iteration_timeout` seconds (0: no limit); None if it can."""
    if not engine.is_running:
        return f"the engine stopped: {engine.error}" if engine.error else "the engine was shut down"
    busy = engine.busy_seconds()
    if iteration_timeout and busy > iteration_timeout:
        return (
            f"the engine's current iteration has run for {busy:.0f} s "
            f"(--engine-iteration-timeout {iteration_timeout:g})"
        )
    return None


async def server_state(request: Request) -> ServerState:
    """The app's ServerState, as a route dependency."""
    return request.app.state.server


async def authorize(request: Request) -> None:
    """The API key check, as a dependency of every route but the open ones."""
    await request.app.state.server.authorize(request)
