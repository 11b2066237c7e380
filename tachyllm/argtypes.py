"""Parsers of command-line values (argparse `type=` callables): bounded numbers, byte sizes, "none".

A leaf module (standard library only), so that both the option declarations in config.py and every
CLI module can use it without importing each other.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def at_least(kind: type, minimum: float, inclusive: bool = True) -> Callable[[str], Any]:
    """A number of `kind` that is >= minimum (> minimum when not inclusive)."""

    def parse(text: str):
        value = kind(text)
        if not (value >= minimum if inclusive else value > minimum):  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {minimum}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


positive_int = at_least(int, 1)
non_negative_int = at_least(int, 0)
positive_float = at_least(float, 0, inclusive=False)
non_negative_float = at_least(float, 0)


def none_or(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """`kind`, or None for the word "none" (any case): how an optional number is unset on the command line."""

    def parse(text: str):
        return None if text.strip().lower() == "none" else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def one_of(choices: tuple, kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """`kind`, which must be one of `choices` (argparse's own check, for a parser whose choices its
    `choices=` cannot list, as an optional one's unset by "none": none_or(one_of(...)))."""

    def parse(text: str):
        value = kind(text)
        if value not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(map(str, choices))} or none)"
            )
        return value

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def byte_size(text: str) -> int:
    """Plain bytes or a size like 512M / 2G / 1.5GiB (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except OverflowError:  # "infG"
        raise ValueError(f"not a finite size: {text!r}") from None


def boolean(text: str) -> bool:
    """true / false (also 1 / 0, yes / no, any case): a flag's explicit truth value."""
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")
