"""The "server" argument group of `tachy serve`: the HTTP server's own options (the engine's are generated
from EngineConfig, engine_args.py). The server reads them from the parsed namespace; a Ray Serve
ingress takes the same namespace."""

from __future__ import annotations

import argparse
import os
from typing import Any

from tachyllm.argtypes import byte_size, non_negative_float, positive_int
from tachyllm.errors import ConfigError


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
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


def server_args(options: dict[str, Any] | None = None) -> argparse.Namespace:
    """The server options of a mapping (keys: the flags without dashes, underscored; values as on the
    command line, or YAML scalars and lists), the rest at their defaults, parsed by the very flags."""
    parser = argparse.ArgumentParser(prog="server options", add_help=False, exit_on_error=False)
    add_server_args(parser)
    known = {action.dest for action in parser._actions}
    argv: list[str] = []
    for key, value in (options or {}).items():
        if key not in known:
            raise ConfigError(f"unknown server option {key!r} (the server options: {', '.join(sorted(known))})")
        argv.append("--" + key.replace("_", "-"))
        argv += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"server option {e.argument_name}: {e.message}") from None
