"""`tachy serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) around one engine."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.entrypoints.cli import add_engine_args, engine_config, non_negative_float, positive_int

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tachyllm.server.app import ServerState


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="model name(s) clients may ask for; the first is reported in responses "
        "(default: --model, or the embedded model's name)",
    )  # fmt: skip
    g.add_argument(
        "--api-key", default=os.environ.get("TACHY_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API (default: $TACHY_API_KEY; unset = open)",
    )  # fmt: skip
    g.add_argument(
        "--max-queue-len", type=positive_int, default=None,
        help="answer 503 while this many requests wait to run (default: unlimited)",
    )  # fmt: skip
    g.add_argument(
        "--shutdown-timeout", type=non_negative_float, default=30.0,
        help="on SIGTERM/SIGINT, seconds to let admitted requests finish before aborting them",
    )  # fmt: skip
    g.add_argument(
        "--log-stats-interval", type=non_negative_float, default=10.0,
        help="seconds between engine stats log lines; 0 = never",
    )  # fmt: skip
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


class GracefulServer(uvicorn.Server):
    """First SIGTERM/SIGINT: new requests get 503 while admitted ones finish (up to the shutdown
    timeout, then they are aborted), then a normal exit with status 0. A second signal exits at once.

    uvicorn's own handler records the signal and re-raises it after shutdown, which would end the
    process by the signal rather than with status 0; this one does not."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None  # held so the task is not garbage-collected

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        # A signal handler may interrupt the loop anywhere; call_soon_threadsafe is safe from there.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        await self._state.drain(self._shutdown_timeout)
        self.should_exit = True


def make_server(app: FastAPI, args: argparse.Namespace) -> GracefulServer:
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # keep the `tachy` logging setup
        timeout_graceful_shutdown=5,  # after the drain, streams only need to flush their last bytes
    )
    return GracefulServer(config, app.state.server, args.shutdown_timeout)


def cmd_serve(args: argparse.Namespace) -> int:
    # FastAPI loads here, so the other subcommands start without it.
    from tachyllm.server.app import build_app
    from tachyllm.server.async_engine import AsyncEngine

    def build_engine() -> LLMEngine:
        llm_engine = LLMEngine(engine_config(args))
        # The engine's own periodic status line is the server's too; 0 turns it off.
        llm_engine.stats_logger.interval_s = args.log_stats_interval or math.inf
        return llm_engine

    engine = AsyncEngine(build_engine)
    make_server(build_app(engine, args), args).run()
    return 0
