"""`tachy serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) around one engine."""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import logging
import math
import os
import socket
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from tachyllm.argtypes import non_negative_int, positive_int
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import add_engine_args, engine_config
from tachyllm.errors import ConfigError
from tachyllm.loading.generation_config import generation_config_file
from tachyllm.otel import otlp_exporter
from tachyllm.ray_serve.config import ROUTER_POLICIES, parse_autoscale
from tachyllm.server.options import add_server_args

logger = logging.getLogger("tachyllm.server")

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tachyllm.server.state import ServerState


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="the model to serve, as `vllm serve MODEL` takes it (the same as --model MODEL)",
    )  # fmt: skip
    add_server_args(serve)
    add_scale_out_args(serve)
    add_engine_args(serve, repeatable={"model": "several --model NAME=PATH serve several models (on Ray Serve)"})
    serve.set_defaults(func=cmd_serve)


def add_scale_out_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scale-out (Ray Serve; docs/scale_out.md)")
    g.add_argument(
        "--replicas", type=positive_int, default=None, metavar="N",
        help="serve N engine replicas of each model on Ray Serve (a local Ray instance unless --ray-address)",
    )  # fmt: skip
    g.add_argument(
        "--autoscale", type=parse_autoscale, default=None, metavar="MIN:MAX",
        help="let Ray Serve scale each model between MIN and MAX replicas with its load",
    )  # fmt: skip
    g.add_argument(
        "--threads-per-replica", type=positive_int, default=None, metavar="T",
        help="compute threads of each replica (default: the cores divided among the replicas)",
    )  # fmt: skip
    g.add_argument(
        "--ray-address", default=None, metavar="ADDR", help="join this Ray cluster (e.g. auto, or ray://head:10001)"
    )
    g.add_argument(
        "--config", default=None, metavar="MODELS_YAML",
        help="serve the models of this YAML file, each with its engine options, replicas and autoscaling",
    )  # fmt: skip
    g.add_argument(
        "--router", choices=ROUTER_POLICIES, default="prefix",
        help="how requests pick a replica: prefix (the replica holding the longest cached prefix), power_of_two "
        "(Ray Serve's default), round_robin",
    )  # fmt: skip
    g.add_argument(
        "--router-load-margin", type=non_negative_int, default=8, metavar="K",
        help="a prefix hit is taken while its replica's queue is at most this much longer than the shortest",
    )  # fmt: skip


def apply_model_tag(args: argparse.Namespace) -> None:
    """`tachy serve MODEL` is `tachy serve --model MODEL`; both at once must agree."""
    tag = args.model_tag
    if tag is None:
        return
    if args.model_all and args.model_all != [tag]:
        given = " ".join(f"--model {m}" for m in args.model_all)
        raise ConfigError(f"the model is given twice, as {tag} and as {given}: give one")
    args.model, args.model_all = tag, [tag]


def check_before_loading(args: argparse.Namespace) -> None:
    """What can be refused in a moment is refused before the model loads (which takes seconds to minutes):
    a model path that is missing or unreadable, a --generation-config folder without its file."""
    # NAME=PATH models (Ray Serve) are checked by ray_serve.config.check_model_paths, naming the model.
    for path in [spec for spec in args.model_all or [] if "=" not in spec]:
        if not os.path.exists(path):
            raise ConfigError(f"model path does not exist: {path}")
        if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            raise ConfigError(f"model path is not readable: {path}")
    generation_config_file(args.generation_config, args.model)
    if args.otlp_traces_endpoint is not None:
        otlp_exporter(args.otlp_traces_endpoint)  # the tracing extra is installed, the protocol known


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening now (before the model loads) so that a port in use fails at
    once, and uvicorn serves on this very socket once the engine is ready: no other process can take the
    port in between. It listens at once because, with SO_REUSEADDR, Linux lets two sockets bind one port
    while neither listens (two servers started together would both pass). Connections made while the
    model loads wait in the kernel's queue until the server answers them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = (
            "the port is in use (another server?); choose another --port" if e.errno == errno.EADDRINUSE else e.strerror
        )
        raise ConfigError(f"cannot listen on {host}:{port}: {why}") from None
    sock.listen(2048)  # uvicorn's default backlog
    return sock


def uses_ray(args: argparse.Namespace) -> bool:
    named = any("=" in m for m in args.model_all)
    return bool(args.replicas or args.autoscale or args.config or args.ray_address or named)


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

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            # The address actually bound (uvicorn's own line repeats --port, 0 included): how a client
            # or a test finds a server started with --port 0.
            for sock in [sock for server in self.servers for sock in server.sockets]:
                host, port = sock.getsockname()[:2]
                logger.info("serving on http://%s:%d", f"[{host}]" if ":" in host else host, port)

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
        for engine in self._state.engines:
            engine.abandon("the server is shutting down", failed=False)
        self._start_drain()  # the drain now finds nothing left and ends at once

    async def _drain(self, timeout: float) -> None:
        await self._state.drain(timeout)
        self.should_exit = True

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(self.WATCHDOG_INTERVAL_S)
            if self._signals >= 2 or (problem := self._state.health_problem()) is None:
                continue  # after a second signal the engine is stopped on purpose
            logger.error("%s; shutting down with exit status 1 so that a supervisor restarts the server", problem)
            self.exit_code = 1
            for engine in self._state.engines:
                engine.abandon(problem, failed=True)  # open streams end with that error
            self._start_drain(min(self._shutdown_timeout, 5.0))
            return


def make_server(app: FastAPI, args: argparse.Namespace) -> GracefulServer:
    # Loaded with the app (it imports the server's modules): the other subcommands start without them.
    from tachyllm.server.http_protocol import ConnectionLimits, GuardedHttpProtocol

    limits = ConnectionLimits(args.header_read_timeout, args.max_connections)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=functools.partial(GuardedHttpProtocol, limits=limits),  # type: ignore[arg-type]
        log_config=None,  # keep the `tachy` logging setup
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,  # after the drain, streams only need to flush their last bytes
    )
    return GracefulServer(config, app.state.server, args.shutdown_timeout)


def cmd_serve(args: argparse.Namespace) -> int:
    apply_model_tag(args)
    if uses_ray(args):
        check_before_loading(args)
        # Ray's proxy takes the port later; a port in use is told now (it could still be taken in between).
        bind_socket(args.host, args.port).close()
        # Ray loads here, so that a single-engine server never imports it.
        from tachyllm.ray_serve.launch import serve_on_ray

        return serve_on_ray(args)
    if len(args.model_all) > 1:
        raise ConfigError("several --model flags serve several models: give each as NAME=PATH (uses Ray Serve)")
    check_before_loading(args)
    sock = bind_socket(args.host, args.port)
    # FastAPI loads here, so the other subcommands start without it.
    from tachyllm.server.app import build_app
    from tachyllm.server.async_engine import AsyncEngine

    def build_engine() -> LLMEngine:
        llm_engine = LLMEngine(engine_config(args))
        # The engine's own periodic status line is the server's too; 0 turns it off.
        llm_engine.stats_logger.interval_s = args.log_stats_interval or math.inf
        return llm_engine

    with sock:
        engine = AsyncEngine(build_engine)
        server = make_server(build_app(engine, args), args)
        server.run(sockets=[sock])
    return server.exit_code
