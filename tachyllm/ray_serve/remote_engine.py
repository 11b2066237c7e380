"""RemoteEngine: the server's EngineClient over a model deployment's replicas, through a DeploymentHandle.

The ingress checks and tokenizes requests itself (with the replicas' own tokenizer and limits, from
EngineReplica.describe), hashes the prompt's full blocks with the replicas' hash chain for the
router, and streams each request from the replica the router chose. A replica that dies before the
request has streamed a token gets the request again on another replica, once; after that, the
stream ends with an error (an OpenAI-format error event, for a streamed response).
"""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import RayActorError

from tachyllm.core.block_manager import hash_block
from tachyllm.engine.input_processor import ProcessedRequest
from tachyllm.errors import RequestError
from tachyllm.outputs import RequestOutput
from tachyllm.ray_serve.replica import ACCEPTED, EngineInfo, RemoteError
from tachyllm.ray_serve.router_metrics import router_metrics
from tachyllm.sampling_params import SamplingParams
from tachyllm.server.async_engine import EngineDeadError, QueueFullError
from tachyllm.server.errors import APIError

logger = logging.getLogger("tachyllm.ray_serve")

try:  # raised for a replica that is restarting rather than dead
    from ray.exceptions import ActorUnavailableError
except ImportError:  # pragma: no cover
    ActorUnavailableError = RayActorError

REPLICA_GONE = (RayActorError, ActorUnavailableError)


def prompt_block_hashes(token_ids: list[int], info: EngineInfo) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the replicas' block managers compute them."""
    if not info.prefix_caching:
        return []
    bs, hashes = info.block_size, []
    for i in range(len(token_ids) // bs):
        hashes.append(
            hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], info.prefix_cache_key)
        )
    return hashes


def remote_error(error: RemoteError) -> Exception:
    """The exception the server's admission and streaming code already answers for."""
    if error.kind == "refused":
        return RequestError(error.message, param=error.param)
    if error.kind == "queue_full":
        return QueueFullError(error.num_queued, error.limit)
    return EngineDeadError(error.message)


def replica_lost(request_id: str) -> APIError:
    return APIError(
        503,
        f"the replica running request {request_id} died after it had started streaming; retry the request",
        "service_unavailable_error",
        code="replica_failed",
    )


class RemoteStream:
    """One request's outputs from a replica, iterated and closed like the server's RequestStream."""

    def __init__(self, engine: RemoteEngine, request_id: str, request: ProcessedRequest, max_queued: int | None):
        self.request_id = request_id
        self._engine = engine
        self._request = request
        self._max_queued = max_queued
        self._hashes = prompt_block_hashes(request.prompt_token_ids, engine.info)
        self._generator = None
        self._retries_left = engine.retries
        self._streamed = False  # a token reached the caller: the request can no longer be retried
        self._done = False

    async def start(self) -> None:
        """Sends the request and waits until a replica's engine took it (raising what refused it)."""
        while True:
            self._generator = self._engine.call(self.request_id, self._request, self._max_queued, self._hashes)
            try:
                first = await self._generator.__anext__()
            except REPLICA_GONE:
                if not self._retry():
                    self._done = True
                    raise EngineDeadError("the replica running this request died, and so did its retry") from None
                continue
            if isinstance(first, RemoteError):
                self._done = True
                raise remote_error(first)
            assert first == ACCEPTED, first
            self._engine.open_streams.add(self)
            return

    def _retry(self) -> bool:
        if self._streamed or self._retries_left <= 0:
            return False
        self._retries_left -= 1
        router_metrics().retries.labels(self._engine.name).inc()
        logger.warning("request %s: its replica died before the first token; retrying on another", self.request_id)
        return True

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._done:
                raise StopAsyncIteration
            try:
                item = await self._generator.__anext__()
            except StopAsyncIteration:
                self._finish()
                raise
            except REPLICA_GONE:
                if not self._retry():
                    self._finish()
                    raise replica_lost(self.request_id) from None
                self._engine.open_streams.discard(self)
                await self.start()
                continue
            if isinstance(item, RemoteError):
                self._finish()
                raise remote_error(item)
            if any(c.token_ids for c in item.outputs):
                self._streamed = True
            if item.finished:
                self._finish()
            return item

    def _finish(self) -> None:
        self._done = True
        self._engine.open_streams.discard(self)

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
        self.error: BaseException | None = None  # Ray restarts failed replicas: the engine as a whole never fails
        self.retries = retries
        self.open_streams: set[RemoteStream] = set()
        self._generate = handle.options(stream=True, method_name="generate")

    def call(self, request_id: str, request: ProcessedRequest, max_queued: int | None, hashes: list[bytes]):
        return self._generate.remote(request_id, request, max_queued, hashes)

    async def add_requests(
        self, requests: list[tuple[str, ProcessedRequest, SamplingParams]], max_queued: int | None = None
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
