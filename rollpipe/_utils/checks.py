"""Argument checks shared by rollpipe: ``check_int`` for plain arguments, attrs validators
for frozen configs and records.

Every message names the argument (``Class.field``), the bad value, and the accepted range.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = [
    "check_int",
    "check_timeout",
    "float_in",
    "instance_of",
    "int_at_least",
    "one_of",
    "optional",
]

optional = attrs.validators.optional


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """``value`` if it is an ``int`` (not a bool) ``>= minimum``, else a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_timeout(name: str, value: object) -> float | None:
    """``value`` if it is None (no limit) or a finite number of seconds > 0, else a
    ValueError naming it."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value > 0):  # type: ignore[operator, arg-type]
        raise ValueError(
            f"{name} must be None (no limit) or a number of seconds in (0, inf), got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def int_at_least(low: int) -> Any:
    """An ``int`` (not a bool) ``>= low``."""

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        check_int(f"{type(inst).__name__}.{attr.name}", value, low)

    return check


def float_in(low: float, high: float = math.inf, *, low_open: bool = False) -> Any:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and (low < value if low_open else low <= value)
        if not (ok and value <= high):
            lo = "(" if low_open else "["
            raise ValueError(
                f"{type(inst).__name__}.{attr.name} must be a number in {lo}{low}, {high}], "
                f"got {value!r}"
            )

    return check


def instance_of(*types: type) -> Any:
    """A value of one of ``types`` (a bool is not an int here, nor an int a bool)."""
    names = " or ".join(t.__name__ for t in types)

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            raise ValueError(
                f"{type(inst).__name__}.{attr.name} must be {names}, got {value!r} "
                f"({type(value).__name__})"
            )

    return check


def one_of(*choices: object) -> Any:
    """One of ``choices`` (compared with ``==``, a bool never standing for 0 or 1)."""

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not any(value == c for c in choices):
            raise ValueError(
                f"{type(inst).__name__}.{attr.name} must be one of {choices}, got {value!r}"
            )

    return check
