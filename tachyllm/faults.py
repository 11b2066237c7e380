"""Fault injection for tests: every stage of an engine step calls check(stage, seqs).

Nothing happens unless a test installed a hook with `injected(hook)`; the hook gets the stage and
the request ids the stage works on, and may raise (a fault in that stage) or sleep (a hung step).
The tests use it to show that a failure anywhere in a step fails only the requests it concerns,
returns their KV blocks, and leaves the engine serving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

# In the order a step runs them.
STAGES = ("schedule", "prepare", "forward", "sample", "detokenize", "output")

FaultHook = Callable[[str, list[str]], None]
_hook: FaultHook | None = None


class OfRequest(Protocol):
    """A sequence, or a step's plain entry for one (tachyllm.step.ScheduledSeq)."""

    @property
    def request_id(self) -> str: ...


def check(stage: str, seqs: Iterable[OfRequest]) -> None:
    if _hook is not None:
        _hook(stage, [s.request_id for s in seqs])


@contextmanager
def injected(hook: FaultHook) -> Iterator[None]:
    global _hook
    previous, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = previous
