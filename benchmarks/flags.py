"""Argument types for the benchmarks' numeric flags. A count or a time a benchmark cannot use (0
repeats, -1 rounds) is a usage error as argparse says it (exit 2, one line naming the flag), not a
run that fails later or a row that says FAILED."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """A whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


at_least_one = at_least(1)  # repeats, rounds, iterations, a batch's size


def seconds(text: str) -> float:
    """A finite time > 0 (a budget, a timeout)."""
    return _number(text, lambda value: value > 0, "a number of seconds > 0")


def seconds_or_zero(text: str) -> float:
    """A finite time >= 0, where 0 turns the wait off."""
    return _number(text, lambda value: value >= 0, "a number of seconds >= 0")


def positive(text: str) -> float:
    """A finite number > 0 (a learning rate, a device's peak)."""
    return _number(text, lambda value: value > 0, "a number > 0")


def _number(text: str, holds: Callable[[float], bool], what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or not holds(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value
