"""Python function calls made by a piece of code: a cost measure that load on the machine does not move."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class CallCounter:
    """Counts Python and builtin function calls while entered; `calls` may be read inside, to tell
    which part of the counted code made them."""

    def __init__(self) -> None:
        self.calls = 0

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def __enter__(self) -> CallCounter:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def count_calls(fn: Callable[[], T]) -> tuple[T, int]:
    """fn's result and the number of Python and builtin function calls it made."""
    with CallCounter() as counter:
        result = fn()
    return result, counter.calls
