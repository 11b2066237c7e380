"""Named spans around the stages of an engine step, for profilers (`tachy bench latency --profile`).

The engine, the runner and the model open a span at each stage (STAGES); nothing happens unless a
tracer is installed with `traced(tracer)`, a callable that takes the stage name and returns a
context manager (e.g. torch.profiler.record_function). Process-wide, as a profiler is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

STAGES = ("schedule", "prepare_inputs", "forward", "attention", "sample")

Tracer = Callable[[str], AbstractContextManager]
_NOTHING = nullcontext()
_tracer: Tracer | None = None


def span(stage: str) -> AbstractContextManager:
    return _NOTHING if _tracer is None else _tracer(stage)


@contextmanager
def traced(tracer: Tracer) -> Iterator[None]:
    global _tracer
    previous, _tracer = _tracer, tracer
    try:
        yield
    finally:
        _tracer = previous
