"""The OpenAI-compatible HTTP API over an AsyncEngine: build_app(engine, args) -> FastAPI.

A request is validated completely (types, ranges, context length, model name) before anything
reaches the engine, and waits until the engine has accepted it before the response starts, so
every refusal is a plain JSON error and never a half-sent stream. The routes live in
server/routes/; this module assembles them with the error handlers, the middleware and the
engine's shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from tachyllm.errors import ConfigError
from tachyllm.lora.peft import load_peft_adapter
from tachyllm.lora.request import LoRARequest
from tachyllm.model_config import ModelConfig
from tachyllm.otel import RequestTracer, TraceOptions
from tachyllm.server.async_engine import AsyncEngine, EngineDeadError
from tachyllm.server.errors import APIError, engine_dead
from tachyllm.server.guard import RequestGuard, default_allowed_hosts
from tachyllm.server.metrics import MetricsOptions, ServerMetrics
from tachyllm.server.openapi import ERROR_RESPONSES
from tachyllm.server.request_trace import RequestTracing, dropped_spans_metrics
from tachyllm.server.responses import json_response
from tachyllm.server.routes import (
    chat,
    completions,
    embeddings,
    lora_adapters,
    models,
    responses,
    score,
    service,
    tokenize,
)
from tachyllm.server.state import MetricsSource, RequestLimits, RuntimeLoRA, ServedModel, ServerState, authorize
from tachyllm.version import __version__


def build_app(engine: AsyncEngine, args: argparse.Namespace) -> FastAPI:
    """The server of one engine in this process."""
    served = ServedModel(list(args.served_model_name or [engine.model_name]), engine, args.tool_call_parser)
    metrics = ServerMetrics(served.name, engine.max_model_len, metrics_options(args))
    engine.add_output_listener(metrics.observe)

    async def local_metrics() -> list[tuple[dict[str, str], bytes]]:
        return [({}, metrics.render(engine.snapshot))]

    adapters = lora_models(served, engine.model_config, args)
    state = server_state([served, *adapters], args, [local_metrics])
    if args.allow_runtime_lora_updating:
        if not args.enable_lora:
            raise ConfigError("--allow-runtime-lora-updating needs --enable-lora")
        state.runtime_lora = RuntimeLoRA(served, engine.model_config, args.max_lora_rank, next_id=len(adapters) + 1)
    return assemble_app(state, args, engine.trace_options)


def lora_models(base: ServedModel, model_config: ModelConfig, args: argparse.Namespace) -> list[ServedModel]:
    """A model per --lora-modules adapter, on the base model's engine; each adapter is read and checked
    against the base model now, so that a bad one stops the server before it serves."""
    modules = args.lora_modules
    if modules and not args.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    names = set(base.names)
    served = []
    for int_id, module in enumerate(modules, start=1):
        if module.name in names:
            raise ConfigError(f"--lora-modules: the name {module.name!r} is already served")
        names.add(module.name)
        load_peft_adapter(module.path, model_config, args.max_lora_rank)
        lora = LoRARequest(module.name, int_id, module.path)
        parent = module.base_model_name or base.name
        served.append(ServedModel([module.name], base.engine, base.tool_call_parser, lora=lora, parent=parent))
    return served


def metrics_options(args: argparse.Namespace) -> MetricsOptions:
    return MetricsOptions(args.metrics_prefix, not args.disable_log_requests)


def server_state(models: list[ServedModel], args: argparse.Namespace, metrics: list[MetricsSource]) -> ServerState:
    limits = RequestLimits(args.max_n, args.max_prompts_per_request, args.max_request_tokens, args.max_pooling_inputs)
    return ServerState(models, args.api_key, args.max_queue_len, metrics, limits, args.engine_iteration_timeout)


def assemble_app(state: ServerState, args: argparse.Namespace, tracing: TraceOptions | None = None) -> FastAPI:
    """The API's routes over `state`'s engines, with the error handlers and the HTTP policy of `args`, and
    request tracing where `tracing` says where the traces go."""
    tracer = RequestTracer(tracing) if tracing is not None else None
    # No interactive docs pages, which would load scripts from elsewhere; routes/service.py serves
    # the OpenAPI document itself.
    app = FastAPI(
        title="tachyllm",
        version=__version__,
        lifespan=shut_down(tracer),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        responses={421: ERROR_RESPONSES[421]},  # the Host check answers it before any route
    )
    app.state.server = state
    # A proxy's path prefix (as vLLM sets it; FastAPI's constructor argument for it is deprecated).
    app.root_path = args.root_path
    app.add_exception_handler(APIError, on_api_error)  # type: ignore[arg-type]  # Starlette types handlers over Exception
    app.add_exception_handler(EngineDeadError, on_engine_dead)  # type: ignore[arg-type]  # Starlette types handlers over Exception
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]  # Starlette types handlers over Exception
    app.add_exception_handler(Exception, on_bug)

    app.include_router(service.router)
    admin = (lora_adapters,) if state.runtime_lora is not None else ()  # off unless enabled
    for routes in (models, completions, chat, responses, embeddings, score, tokenize, *admin):
        app.include_router(routes.router, dependencies=[Depends(authorize)], responses={401: ERROR_RESPONSES[401]})
    # Refusals (host, content type, size) happen before routing, for every route; CORS, when on,
    # is added last and so wraps them: an allowed page can read a refusal too.
    app.add_middleware(
        RequestGuard,
        max_body_bytes=args.max_request_body_bytes,
        allowed_hosts=allowed_hosts(args),
        body_timeout=args.body_read_timeout,
    )
    if tracer is not None:  # outside the guard: its refusals are traced too
        app.add_middleware(RequestTracing, tracer=tracer)
        state.metrics_sources.append(dropped_spans_metrics(tracer, args.metrics_prefix))
    app.state.tracer = tracer
    if args.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_methods=args.allowed_methods,
            allow_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
        )
    return app


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    return args.allowed_hosts if args.allowed_hosts else default_allowed_hosts(args.host)


def shut_down(tracer: RequestTracer | None):
    """The app's lifespan: at its end the engines stop, then the tracer exports what it still holds."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            # A hung step never returns: give up on it after a while (its thread is a daemon).
            for engine in app.state.server.engines:
                await asyncio.to_thread(engine.shutdown, 10.0)
            if tracer is not None:
                await asyncio.to_thread(tracer.shutdown)

    return lifespan


async def on_api_error(request: Request, e: APIError) -> Response:
    return json_response(e.body, e.status, e.headers)


async def on_engine_dead(request: Request, e: EngineDeadError) -> Response:
    error = engine_dead(e, any(engine.error is not None for engine in request.app.state.server.engines))
    return json_response(error.body, error.status)


async def on_http_error(request: Request, e: StarletteHTTPException) -> Response:
    error = APIError(
        e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"
    )
    return json_response(error.body, error.status, dict(e.headers) if e.headers is not None else None)


async def on_bug(request: Request, e: Exception) -> Response:
    error = APIError(500, f"internal server error ({type(e).__name__}: {e})", "internal_error")
    return json_response(error.body, error.status)
