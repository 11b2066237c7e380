"""The "server" argument group of `tachy serve`: the HTTP server's own options (the engine's are generated
from EngineConfig, engine_args.py). The server reads them from the parsed namespace; a Ray Serve
ingress takes the same namespace."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from tachyllm.argtypes import byte_size, non_negative_float, positive_int
from tachyllm.errors import ConfigError

METRICS_PREFIXES = ("tachy", "vllm")  # server/metrics.py: MetricsOptions.prefix
# The tool-call formats of server/tools.py: hermes (the template's <tool_call> blocks), json (tachyllm's
# generic JSON object, for templates without tool calls).
TOOL_CALL_PARSERS = ("hermes", "json")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ListOrJson(argparse.Action):
    """A list flag given as several values (--allowed-origins a b) or as vLLM writes it, one JSON list
    (--allowed-origins '["a", "b"]')."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items: list[str] = []
        for value in values:
            if not value.lstrip().startswith("["):
                items.append(value)
                continue
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = None
            if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
                raise argparse.ArgumentError(self, f"expected values or a JSON list of strings, got {value!r}")
            items += parsed
        setattr(namespace, self.dest, items)


@dataclass(frozen=True)
class LoRAModule:
    """A LoRA adapter the server serves as a model of its own (--lora-modules); `base_model_name`: the
    model /v1/models names as its parent (default: the served base model's name)."""

    name: str
    path: str
    base_model_name: str | None = None


def lora_module(text: str) -> LoRAModule:
    """--lora-modules' value: name=path, or vLLM's JSON {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON in a --lora-modules value {text!r}: {e}") from None
        fields = {"name", "path", "base_model_name"}
        if not isinstance(spec, dict) or not {"name", "path"} <= set(spec) <= fields:
            raise argparse.ArgumentTypeError(
                f'a JSON --lora-modules value needs "name" and "path" (and may have "base_model_name"), got {text!r}'
            )
        if not all(isinstance(v, str) and v for v in spec.values()):
            raise argparse.ArgumentTypeError(f"the --lora-modules fields must be non-empty strings, got {text!r}")
        return LoRAModule(spec["name"], spec["path"], spec.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected --lora-modules name=path (or vLLM's JSON form), got {text!r}")
    return LoRAModule(name, path)


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number (0-65535), got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535 (0 = any free one), got {port}")
    return port


def tool_call_parser(text: str) -> str:
    if text not in TOOL_CALL_PARSERS:
        raise argparse.ArgumentTypeError(
            f"tachyllm has no tool call parser {text!r}; its parsers: hermes (<tool_call> blocks, as Qwen2.5 and "
            "Hermes write them), json (tachyllm's generic format, for any model)"
        )
    return text


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=port_number, default=8000, help="TCP port (0 = any free one)")
    g.add_argument(
        "--root-path", default="",
        help="the path prefix under which a proxy in front serves this server, e.g. /llm (FastAPI's root_path)",
    )  # fmt: skip
    g.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="model name(s) clients may ask for; the first is reported in responses "
        "(default: --model, or the embedded model's name)",
    )  # fmt: skip
    g.add_argument(
        "--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served as models of their own, each selected by its name in a "
        "request's model: name=path, or vLLM's JSON {\"name\": ..., \"path\": ..., \"base_model_name\": ...} "
        "(needs --enable-lora; docs/lora.md)",
    )  # fmt: skip
    g.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, an admin operation: anyone who may "
        "call the API may then make the server read a directory (needs --enable-lora; default: "
        "$VLLM_ALLOW_RUNTIME_LORA_UPDATING, else off)",
    )  # fmt: skip
    g.add_argument(
        "--api-key", default=os.environ.get("TACHY_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API (default: $TACHY_API_KEY; unset = open)",
    )  # fmt: skip
    g.add_argument(
        "--max-queue-len", type=positive_int, default=None,
        help="answer 503 while this many requests wait for a batch slot, beyond the --max-num-seqs running "
        "(default: unlimited)",
    )  # fmt: skip
    g.add_argument(
        "--max-request-body-bytes", type=byte_size, default=4 << 20,
        help="refuse request bodies larger than this with 413, e.g. 4M (default: 4 MiB)",
    )  # fmt: skip
    g.add_argument(
        "--header-read-timeout", type=non_negative_float, default=20.0,
        help="seconds a request's headers may take to arrive (from the connection's opening, or the request's first "
        "byte on a reused connection); slower clients get 408 and are disconnected; 0 = no limit (default: 20)",
    )  # fmt: skip
    g.add_argument(
        "--body-read-timeout", type=non_negative_float, default=60.0,
        help="seconds a request's body may take to arrive after its headers; slower clients get 408 and are "
        "disconnected; 0 = no limit (default: 60)",
    )  # fmt: skip
    g.add_argument(
        "--max-connections", type=positive_int, default=None,
        help="most open client connections; a request on a connection beyond them gets 503 and the connection is "
        "closed (default: no cap but the process's file-descriptor limit)",
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
        help="most tokens one HTTP request may claim: its prompts plus n x max_tokens for each; a pooling request's "
        "inputs' tokens (default: 1048576)",
    )  # fmt: skip
    g.add_argument(
        "--max-pooling-inputs", type=positive_int, default=2048,
        help="most inputs one pooling request may carry: /v1/embeddings inputs, /v1/rerank documents, /v1/score "
        "pairs (default: 2048)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-hosts", nargs="+", default=None,
        help="Host header values the server answers to ('*' = any); others get 421 (default: the loopback names "
        "when bound to loopback, else any)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-origins", nargs="+", action=ListOrJson, default=None,
        help="web origins allowed to call the API from a browser (CORS), e.g. https://app.example.com or '[\"*\"]' "
        "(default: none, CORS off)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-methods", nargs="+", action=ListOrJson, default=["GET", "POST"],
        help="with --allowed-origins: the methods a page may use (default: GET POST)",
    )  # fmt: skip
    g.add_argument(
        "--allowed-headers", nargs="+", action=ListOrJson, default=["Authorization", "Content-Type"],
        help="with --allowed-origins: the request headers a page may send (default: Authorization Content-Type)",
    )  # fmt: skip
    g.add_argument(
        "--allow-credentials", action="store_true",
        help="with --allowed-origins: let pages send cookies and HTTP authentication",
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
    g.add_argument(
        "--disable-log-stats", dest="log_stats_interval", action="store_const", const=0.0,
        help="no engine stats log lines (--log-stats-interval 0)",
    )  # fmt: skip
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    g.add_argument(
        "--enable-log-requests", dest="disable_log_requests", action="store_false",
        help="a log line per finished request (the default; vLLM's flag)",
    )  # fmt: skip
    g.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="accepted for vLLM's command lines: tool_choice auto is always served (docs/tools.md)",
    )  # fmt: skip
    g.add_argument(
        "--tool-call-parser", type=tool_call_parser, default=None, metavar="{hermes,json}",
        help="the tool-call format: hermes (<tool_call> blocks) or json (tachyllm's generic JSON object) "
        "(default: hermes when the chat template writes <tool_call> blocks, else json)",
    )  # fmt: skip
    g.add_argument(
        "--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
        help="level of uvicorn's own loggers, its access log included (default: tachy's --log-level)",
    )  # fmt: skip
    g.add_argument(
        "--metrics-prefix", choices=METRICS_PREFIXES, default="tachy",
        help="/metrics names: tachy (tachy:*, labelled model_name) or vllm (vLLM's exact names and labels, vllm:*, "
        "for vLLM's dashboards)",
    )  # fmt: skip
    g.add_argument(
        "--vllm-metrics", dest="metrics_prefix", action="store_const", const="vllm", help="--metrics-prefix vllm"
    )


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
        if isinstance(value, bool) and parser._option_string_actions[f"--{key.replace('_', '-')}"].nargs == 0:
            argv += ["--" + key.replace("_", "-")] if value else []  # a switch: given or not
            continue
        argv.append("--" + key.replace("_", "-"))
        argv += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"server option {e.argument_name}: {e.message}") from None
