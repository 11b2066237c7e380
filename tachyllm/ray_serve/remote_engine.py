"""RemoteEngine: the server's EngineClient over a model deployment's replicas, through a DeploymentHandle.

The ingress checks and tokenizes requests itself (with the replicas' own tokenizer and limits, from
EngineReplica.describe), hashes the prompt's full blocks with the replicas' hash chain for the
router, and streams each request from the replica the router chose. A replica that dies before the
request has streamed a token gets the request again on another replica, once; after that, the
stream ends with an error (an OpenAI-format error event, for a streamed response).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id

from tachyllm.core.block_manager import extend_block_hashes, servable_blocks
from tachyllm.engine.input_processor import ProcessedRequest
from tachyllm.errors import RequestError
from tachyllm.outputs import EngineOutput, PoolingRequestOutput
from tachyllm.ray_serve.pending_prefill import pending_prefill
from tachyllm.ray_serve.replica import ACCEPTED, EngineInfo, RemoteError
from tachyllm.ray_serve.router_metrics import router_metrics
from tachyllm.server.async_engine import QueueFullError, RequestParams
from tachyllm.server.errors import APIError
from tachyllm.server.request_trace import current_request

logger = logging.getLogger("tachyllm.ray_serve")

# ActorDiedError (a RayActorError) for a killed replica; ActorUnavailableError for one Ray cannot reach.
REPLICA_GONE = (RayActorError, ActorUnavailableError)


def prompt_block_hashes(token_ids: list[int], info: EngineInfo) -> list[bytes]:
    """The chained hashes of the prompt blocks a replica's prefix cache can serve (full blocks, leaving
    the last token to compute: BlockManager.match_prefix), as its block manager computes them."""
    if not info.prefix_caching:
        return []
    num_blocks = servable_blocks(len(token_ids), info.block_size)
    return extend_block_hashes([], token_ids, info.block_size, num_blocks, info.prefix_cache_key)


def remote_error(error: RemoteError) -> Exception:
    """A replica's refusal as the exception the server's admission code already answers (400 or 503)."""
    if error.kind == "queue_full":
        return QueueFullError(error.num_queued, error.limit)
    return RequestError(error.message, param=error.param)


def replica_lost(request_id: str, why: str) -> APIError:
    return APIError(
        503, f"request {request_id}: {why}; retry the request", "service_unavailable_error", code="replica_failed"
    )


class RemoteStream:
    """One request's outputs from a replica, iterated and closed like the server's RequestStream.

    A replica that dies (or whose engine fails) before the request has streamed a token gets it sent
    again, under a new engine request id (a replica that was only unreachable may still hold the old
    one), to whichever replica the router picks; anything that goes wrong with that attempt ends the
    request with replica_failed, as does a death after the first token."""

    def __init__(self, engine: RemoteEngine, request_id: str, request: ProcessedRequest, max_queued: int | None):
        self.request_id = request_id
        self._engine = engine
        self._request = request
        self._max_queued = max_queued
        self._hashes = prompt_block_hashes(request.prompt_token_ids, engine.info)
        self._generator: Any = None  # the current attempt's DeploymentResponseGenerator
        self._attempt = 0
        self._attempt_id = request_id  # the engine request id of the current attempt
        self._streamed = False  # a token reached the caller: the request can no longer be retried
        self._done = False
        self._trace = current_request()  # the request's trace (tracing on): where it was sent, its retries

    async def start(self) -> None:
        """Sends the request and waits until a replica's engine took it (raising what refused it)."""
        while True:
            self._attempt_id = self.request_id if self._attempt == 0 else f"{self.request_id}-retry{self._attempt}"
            self._generator = self._engine.call(self._attempt_id, self._request, self._max_queued, self._hashes)
            if self._trace is not None:
                self._trace.record("routed", engine_request_id=self._attempt_id, attempt=self._attempt)
            try:
                first = await self._generator.__anext__()
            except REPLICA_GONE:
                self._retry_or_fail("its replica died before taking it")
                continue
            if isinstance(first, RemoteError):
                if first.kind == "engine_dead":
                    self._retry_or_fail(f"its replica's engine stopped ({first.message})")
                    continue
                self._finish()
                if self._attempt:  # refused on the second replica: not the client's fault
                    raise replica_lost(self.request_id, f"its replica died and the retry failed ({first.message})")
                raise remote_error(first)
            assert first == ACCEPTED, first
            self._engine.open_streams.add(self)
            return

    def _retry_or_fail(self, why: str) -> None:
        """Drops the current attempt; raises replica_failed unless the request may go again."""
        if self._generator is not None:
            self._generator.cancel()
        self._engine.open_streams.discard(self)
        pending_prefill().done(self._attempt_id)
        if self._streamed or self._attempt >= self._engine.retries:
            self._finish()
            raise replica_lost(self.request_id, why if not self._attempt else f"{why}, on its retry too")
        self._attempt += 1
        router_metrics().retries.labels(self._engine.name).inc()
        if self._trace is not None:
            self._trace.record("retry", reason=why, attempt=self._attempt)
        logger.warning("request %s: %s; sending it again", self.request_id, why)

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> EngineOutput:
        while True:
            if self._done:
                raise StopAsyncIteration
            try:
                item = await self._generator.__anext__()
            except StopAsyncIteration:
                self._finish()
                raise
            except REPLICA_GONE:
                self._retry_or_fail("its replica died" + (" while it streamed" if self._streamed else ""))
                await self.start()
                continue
            if isinstance(item, RemoteError):  # the engine failed midway
                self._retry_or_fail(f"its replica's engine stopped ({item.message})")
                await self.start()
                continue
            # Output reached the caller (a token; a pooling request's one result): no retry from here on.
            produced = isinstance(item, PoolingRequestOutput) or any(c.token_ids for c in item.outputs)
            if not self._streamed and produced:
                self._streamed = True
                pending_prefill().done(self._attempt_id)  # its replica has computed the prompt
            if item.finished:
                self._finish()
            return item

    def _finish(self) -> None:
        self._done = True
        self._engine.open_streams.discard(self)
        pending_prefill().done(self._attempt_id)

    def close(self) -> None:
        """Aborts the request (the replica's generator is cancelled) unless it already finished."""
        if not self._done:
            self._finish()
            if self._generator is not None:
                self._generator.cancel()


class RemoteEngine:
    """An EngineClient (server/state.py) whose engine is a Ray Serve deployment of EngineReplicas."""

    def __init__(self, name: str, handle, info: EngineInfo, retries: int = 1) -> None:
        self.name = name  # the served model's name, for metrics
        self.info = info
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.input_processor = info.input_processor
        self.default_sampling_params = info.default_sampling_params
        self.runner_type = info.runner_type
        self.pooling_tasks = info.pooling_tasks
        self.embedding_dim = info.embedding_dim
        self.is_matryoshka = info.is_matryoshka
        self.error: BaseException | None = None  # Ray restarts failed replicas: the engine as a whole never fails
        self.retries = retries
        self.open_streams: set[RemoteStream] = set()
        self._generate = handle.options(stream=True, method_name="generate")

    def call(self, request_id: str, request: ProcessedRequest, max_queued: int | None, hashes: list[bytes]):
        # Every call made while serving one HTTP request carries that request's internal id, and Ray
        # Serve's router hands a chosen replica to the pending call with the chosen call's id: the
        # calls of a request with several prompts, routed at once, would take each other's replicas
        # (or wait forever). So each call is made under an id of its own.
        return contextvars.copy_context().run(self._call_with_own_id, request_id, request, max_queued, hashes)

    def _call_with_own_id(self, *args):
        context = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(
            dataclasses.replace(context, _internal_request_id=generate_request_id())
        )
        return self._generate.remote(*args)

    async def add_requests(
        self, requests: list[tuple[str, ProcessedRequest, RequestParams]], max_queued: int | None = None
    ) -> list[RemoteStream]:
        """Sends every request and waits until each is taken. Requests of one HTTP request may land on
        different replicas, so a refusal of one closes the others, which may already have started."""
        streams = [RemoteStream(self, request_id, request, max_queued) for request_id, request, _ in requests]
        results = await asyncio.gather(*(s.start() for s in streams), return_exceptions=True)
        if failures := [r for r in results if isinstance(r, BaseException)]:
            for stream in streams:
                stream.close()
            raise failures[0]
        return streams

    @property
    def is_running(self) -> bool:
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self.open_streams)

    def busy_seconds(self) -> float:
        return 0.0  # each replica's own health check watches its step

    def abort_all(self) -> None:
        for stream in list(self.open_streams):
            stream.close()

    def abandon(self, reason: str, failed: bool) -> None:
        self.abort_all()

    def shutdown(self, timeout: float | None = None) -> None:
        self.abort_all()
