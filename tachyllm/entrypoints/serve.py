"""`tachy serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) around one engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from tachyllm.argtypes import byte_size, non_negative_float, positive_int
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.entrypoints.engine_args import add_engine_args, engine_config

logger = logging.getLogger("tachyllm.server")

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tachyllm.server.state import ServerState


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
        "--max-request-body-bytes", type=byte_size, default=4 << 20,
        help="refuse request bodies larger than this with 413, e.g. 4M (default: 4 MiB)",
    )  # fmt: skip
    g.add_argument(
        "--max-n", type=positive_int, default=128, help="largest n (choices per prompt) a request may ask for"
    )
    g.add_argument(
        "--max-prompts-per-request", type=positive_int, default=256,
        help="most prompts one /v1/completions request may carry",
    )  # fmt: skip
    g.add_argument(
        "--max-request-tokens", type=positive_int, default=1 << 20,
        help="most tokens one HTTP request may claim: its prompts plus n x max_tokens for each (default: 1048576)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-hosts", nargs="+", default=None,
        help="Host header values the server answers to ('*' = any); others get 421 (default: the loopback names "
        "when bound to loopback, else any)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-origins", nargs="+", default=None,
        help="web origins allowed to call the API from a browser (CORS), e.g. https://app.example.com (default: none)",
    )  # fmt: skip
    g.add_argument(
        "--engine-iteration-timeout", type=non_negative_float, default=60.0,
        help="seconds one engine step may run before the engine counts as hung: /health turns 503 and the server "
        "exits with status 1 for its supervisor to restart it; 0 = no limit",
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
    timeout, then they are aborted), then a normal exit with status 0. A second signal ends every
    open request at once (streams get an error event) and exits; a third exits without waiting.

    A watchdog checks the engine twice a second, draining or not: once its loop has died or an
    iteration hangs past --engine-iteration-timeout, open requests end with that error and the
    server exits with status 1 (exit_code), so that a supervisor restarts it instead of a live
    process answering errors forever.

    uvicorn's own handler records the signal and re-raises it after shutdown, which would end the
    process by the signal rather than with status 0; this one does not."""

    WATCHDOG_INTERVAL_S = 0.5

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._state = state
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._draining = False
        self._tasks: set[asyncio.Task] = set()  # held so the tasks are not garbage-collected
        self.exit_code = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn(self._watch_engine())
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._loop is None or self._signals > 2:
            self.should_exit = self.force_exit = True
            return
        # A signal handler may interrupt the loop anywhere; call_soon_threadsafe is safe from there.
        self._loop.call_soon_threadsafe(self._end_now if self._signals == 2 else self._start_drain)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_drain(self, timeout: float | None = None) -> None:
        if not self._draining:
            self._draining = True
            self._spawn(self._drain(self._shutdown_timeout if timeout is None else timeout))

    def _end_now(self) -> None:
        logger.warning("second signal: ending every open request now")
        self._state.engine.abandon("the server is shutting down", failed=False)
        self._start_drain()  # the drain now finds nothing left and ends at once

    async def _drain(self, timeout: float) -> None:
        await self._state.drain(timeout)
        self.should_exit = True

    async def _watch_engine(self) -> None:
        engine = self._state.engine
        while not self.should_exit:
            await asyncio.sleep(self.WATCHDOG_INTERVAL_S)
            if self._signals >= 2 or (problem := self._state.health_problem()) is None:
                continue  # after a second signal the engine is stopped on purpose
            logger.error("%s; shutting down with exit status 1 so that a supervisor restarts the server", problem)
            self.exit_code = 1
            engine.abandon(problem, failed=True)  # open streams end with that error
            self._start_drain(min(self._shutdown_timeout, 5.0))
            return


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
    server = make_server(build_app(engine, args), args)
    server.run()
    return server.exit_code
