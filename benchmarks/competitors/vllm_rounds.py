"""The competitor's side of a side-by-side benchmark: run by the competitor's own Python, imports
nothing of tachyllm. `serve_rounds` prints one JSON line when the script is ready, then one JSON line
per `round` line read on stdin; round_process.py is the other side. Everything else the script and its
libraries print (vLLM logs to stdout, its engine processes inherit the descriptor) goes to stderr, so
that stdout carries the results alone."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

Round = Callable[[], dict[str, Any]]


def error_text(exc: BaseException) -> str:
    """The exception's type and message, as its traceback's last line says it."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def serve_rounds(setup: Callable[[], tuple[dict[str, Any], Round]]) -> None:
    """Calls setup() (which returns the ready message and the round function), answers with
    {"ready": message} or {"error": text}, then runs a round per `round` line until stdin ends."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(message: dict[str, Any]) -> None:
        results.write(json.dumps(message) + "\n")

    try:
        ready, run_round = setup()
    except Exception as exc:
        traceback.print_exc()
        send({"error": error_text(exc)})
        sys.exit(1)
    send({"ready": ready})
    for line in sys.stdin:
        if line.strip() != "round":
            send({"error": f"expected 'round' on stdin, got {line.strip()!r}"})
            sys.exit(2)
        send(run_round())
