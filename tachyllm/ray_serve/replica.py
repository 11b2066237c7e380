"""EngineReplica: one Ray Serve replica holding one AsyncEngine, streaming a request's outputs back to the
ingress, reporting its prefix-cache events and metrics to the RoutingHub, and health-checked by Ray
through its engine.

A replica's stream is a small protocol, so that everything the ingress needs to tell "refused" from
"failed" from "died" arrives as data rather than as Ray's wrapped exceptions: first ACCEPTED (the
engine took the request) or a RemoteError (it refused it), then RequestOutputs, and a RemoteError if
the engine fails midway.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from tachyllm.core.block_manager import BlockManager
from tachyllm.engine.input_processor import InputProcessor, ProcessedRequest
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.errors import RequestError
from tachyllm.loading import Tokenizer
from tachyllm.otel import TraceOptions
from tachyllm.ray_serve.config import ModelDeployment, RouterConfig
from tachyllm.ray_serve.hub import routing_hub
from tachyllm.ray_serve.listeners import serve_grpc_on_node_ip
from tachyllm.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from tachyllm.server.metrics import MetricsOptions, ServerMetrics
from tachyllm.server.state import engine_problem

logger = logging.getLogger("tachyllm.ray_serve")

ACCEPTED = "accepted"
METRICS_INTERVAL_S = 1.0


@dataclass
class RemoteError:
    """Why a replica did not (or no longer) run a request, as plain data."""

    kind: str  # "refused" (RequestError), "queue_full", "engine_dead"
    message: str
    param: str | None = None
    num_queued: int = 0
    limit: int = 0


@dataclass
class EngineInfo:
    """What the ingress needs of a replica's engine to check and tokenize requests itself."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer
    input_processor: InputProcessor
    block_size: int
    prefix_cache_key: bytes
    prefix_caching: bool
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    # Where request traces go (the engine's --otlp-traces-endpoint): the ingress makes the spans from
    # what the replica's engine records in each output's metrics.
    trace_options: TraceOptions | None = None
    # What the model is served for (EngineClient's fields of the same names; docs/pooling.md).
    runner_type: Literal["generate", "pooling"] = "generate"
    pooling_tasks: frozenset[str] = frozenset()
    embedding_dim: int | None = None
    is_matryoshka: bool = False


class CacheEventBuffer:
    """Prefix-cache events drained from the block manager on the engine thread (drain, after each step),
    taken by the publisher on the event loop (take). A report that could not be sent is put back
    (restore); a full snapshot of the cache can be asked for at any time (want_full: the hub lost this
    replica's state), and the next drain takes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes: dict[bytes, bool] = {}  # hash -> stored (True) / evicted (False), latest wins
        # _changes is a whole block set (what it does not hold is not cached). The first report is one:
        # recording starts with the engine (EngineReplica), when the cache is empty.
        self._reset = True
        self._want_full = False

    def want_full(self) -> None:
        with self._lock:
            self._want_full = True

    def drain(self, block_manager: BlockManager) -> None:
        """Engine thread only: the block manager is not thread-safe."""
        with self._lock:
            if self._want_full:
                self._changes = dict.fromkeys(block_manager.track_cache_events(), True)
                self._reset, self._want_full = True, False
                return
            stored, evicted = block_manager.drain_cache_events()
            self._merge(stored, evicted)

    def _merge(self, stored: list[bytes], evicted: list[bytes]) -> None:
        for h in stored:
            self._changes[h] = True
        for h in evicted:
            if self._reset:
                self._changes.pop(h, None)  # a whole set lists only what is cached
            else:
                self._changes[h] = False

    def take(self) -> tuple[list[bytes], list[bytes], bool]:
        with self._lock:
            changes, self._changes = self._changes, {}
            reset, self._reset = self._reset, False
        return [h for h, on in changes.items() if on], [h for h, on in changes.items() if not on], reset

    def restore(self, stored: list[bytes], evicted: list[bytes], reset: bool) -> None:
        """Puts back a report that could not be sent, under the events that came after it."""
        with self._lock:
            later, later_reset = self._changes, self._reset
            self._changes = {**dict.fromkeys(stored, True), **dict.fromkeys(evicted, False)}
            self._reset = reset
            if later_reset:  # a new whole set came since: it replaces the old report
                self._changes = later
            else:
                self._merge([h for h, on in later.items() if on], [h for h, on in later.items() if not on])


class EngineReplica:
    """The body of a model's engine deployment (ray_serve.app makes it a @serve.deployment)."""

    # Ray Serve awaits an async constructor.
    async def __init__(  # type: ignore[misc]
        self, model: ModelDeployment, router: RouterConfig, iteration_timeout: float, metrics: MetricsOptions
    ) -> None:
        from ray import serve

        serve_grpc_on_node_ip()
        context = serve.get_replica_context()
        engine_config = model.engine
        self._deployment = model.deployment_name
        self._replica_id = context.replica_id.unique_id
        self._iteration_timeout = iteration_timeout
        self._event_interval_s = router.event_interval_s
        self._hub = routing_hub(context.app_name)
        holder: dict[str, LLMEngine] = {}

        def build() -> LLMEngine:
            engine = LLMEngine(engine_config)
            engine.block_manager.track_cache_events()  # on the engine thread, before any request
            holder["engine"] = engine
            return engine

        self.engine = AsyncEngine(build)
        # The engine's objects belong to its thread from here on; output listeners run there, after
        # every step, and only read the block manager's extra key here (set once, at construction).
        block_manager = holder["engine"].block_manager
        self._events = CacheEventBuffer()
        self.metrics = ServerMetrics(model.name, self.engine.max_model_len, metrics)
        self.engine.add_output_listener(self.metrics.observe)
        self.engine.add_output_listener(lambda _: self._events.drain(block_manager))
        self.info = EngineInfo(
            model_name=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            tokenizer=self.engine.tokenizer,
            input_processor=self.engine.input_processor,
            default_sampling_params=self.engine.default_sampling_params,
            block_size=engine_config.block_size,
            prefix_cache_key=block_manager.extra_key,
            prefix_caching=engine_config.enable_prefix_caching,
            trace_options=self.engine.trace_options,
            runner_type=self.engine.runner_type,
            pooling_tasks=self.engine.pooling_tasks,
            embedding_dim=self.engine.embedding_dim,
            is_matryoshka=self.engine.is_matryoshka,
        )
        self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())

    async def describe(self) -> EngineInfo:
        return self.info

    async def generate(
        self, request_id: str, request: ProcessedRequest, max_queued: int | None, block_hashes: list[bytes]
    ):
        """ACCEPTED or a RemoteError, then the request's outputs. `block_hashes` (the prompt's full blocks)
        are for the router, which reads them from the call's arguments."""
        try:
            stream = (
                await self.engine.add_request(request_id, request, request.params)
                if max_queued is None
                else (await self.engine.add_requests([(request_id, request, request.params)], max_queued=max_queued))[0]
            )
        except RequestError as e:
            yield RemoteError("refused", str(e), e.param)
            return
        except QueueFullError as e:
            yield RemoteError("queue_full", str(e), num_queued=e.num_queued, limit=e.limit)
            return
        except EngineDeadError as e:
            yield RemoteError("engine_dead", str(e))
            return
        try:
            yield ACCEPTED
            async for out in stream:
                yield out
        except EngineDeadError as e:
            yield RemoteError("engine_dead", str(e))
        finally:
            stream.close()  # the ingress went away (cancelled): abort

    def check_health(self) -> None:
        """Ray restarts a replica whose check raises: its engine stopped, or one step hangs."""
        if problem := engine_problem(self.engine, self._iteration_timeout):
            raise RuntimeError(problem)

    async def _publish_loop(self) -> None:
        """Every event interval: the cache events since the last report; every METRICS_INTERVAL_S also
        the metrics (a few kB of text), and at once when a scrape waits for them (hub.py)."""
        metrics_due = 0.0
        scrape = 0  # the latest scrape waiting for this replica's metrics, as the hub last replied
        while True:
            stored, evicted, reset = self._events.take()
            now = time.monotonic()
            metrics, rendered_for = b"", 0
            if now >= metrics_due or scrape:
                metrics, metrics_due = self.metrics.render(self.engine.snapshot), now + METRICS_INTERVAL_S
                rendered_for = scrape
            try:
                reply = await self._hub.publish.remote(
                    self._deployment, self._replica_id, stored, evicted, reset, metrics, os.getpid(), rendered_for
                )
            except Exception:  # the hub is restarting: report these events again next time
                logger.warning("could not report to the routing hub", exc_info=True)
                self._events.restore(stored, evicted, reset)
                metrics_due, scrape = 0.0, 0
            else:
                if reply.needs_full:  # the hub had lost this replica (it restarted, or took it for dead)
                    self._events.want_full()
                scrape = reply.metrics_wanted
                if scrape:  # a scrape is waiting: report again now
                    continue
            await asyncio.sleep(self._event_interval_s)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(5.0)
