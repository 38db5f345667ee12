"""``argparse`` value types shared by the ``dptorch`` subcommands: each rejects a bad value with
a one-line message (argparse then exits with status 2)."""

from __future__ import annotations

import argparse
import math


def _parse(text: str, kind: type, what: str):
    """``kind(text)``, or an ``ArgumentTypeError`` naming the expected value (argparse would
    otherwise report the converter's function name, e.g. "invalid positive_float value")."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_float(text: str) -> float:
    value = _parse(text, float, "a number > 0")
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = _parse(text, float, "a number >= 0")
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def unit_open(text: str) -> float:
    value = _parse(text, float, "a number in (0, 1)")
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1), got {text}")
    return value


def unit_half_open(text: str) -> float:
    value = _parse(text, float, "a number in (0, 1]")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def positive_int(text: str) -> int:
    value = _parse(text, int, "an integer >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value
