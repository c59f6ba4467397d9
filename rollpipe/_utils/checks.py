"""Argument checks shared by rollpipe: ``check_int`` for plain arguments, attrs validators
for frozen configs and records.

Every message names the argument (``Class.field``), the bad value, and the accepted range.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = [
    "check_fields",
    "check_int",
    "check_timeout",
    "float_in",
    "instance_of",
    "int_at_least",
    "int_in",
    "one_of",
    "optional",
    "seconds_or_none",
]

optional = attrs.validators.optional


def check_fields(owner: str, record: type, **values: Any) -> None:
    """Run ``record``'s own attrs validators on ``values`` (field name -> value), errors
    naming ``owner.field``: a node built from keyword arguments checks them with its
    settings record's checks, the one place each rule lives, without building the
    record (which may do more, e.g. build an env)."""
    fields = attrs.fields_dict(record)
    stand_in = type(owner, (), {})()  # the validators name type(inst).__name__
    for name, value in values.items():
        validator = fields[name].validator
        if validator is not None:
            validator(stand_in, fields[name], value)


def check_int(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` if it is an ``int`` (not a bool) in ``[minimum, maximum]``, else a
    ValueError naming it and quoting the range."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        bound = f">= {minimum}"
    elif maximum is not None and value > maximum:
        bound = f"<= {maximum}"
    else:
        return value
    try:
        shown = repr(value)
    except ValueError:  # an int over Python's 4300-digit str limit
        shown = f"an int of about {int(value.bit_length() * 0.30103)} digits"  # type: ignore[attr-defined]
    accepted = "" if maximum is None else f" (accepted: [{minimum}, {maximum}])"
    raise ValueError(f"{name} must be an int {bound}, got {shown}{accepted}")


MAX_TIMEOUT_S = 1e6
"""The longest finite time limit accepted (11.6 days; None means no limit): larger ones
overflow thread waits (``threading.TIMEOUT_MAX``) and are no limit in practice."""


def check_timeout(name: str, value: object) -> float | None:
    """``value`` if it is None (no limit) or a number of seconds in ``(0, MAX_TIMEOUT_S]``,
    else a ValueError naming it."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and 0 < value <= MAX_TIMEOUT_S):  # type: ignore[operator]
        raise ValueError(
            f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], or None for no "
            f"limit, got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def seconds_or_none() -> Any:
    """attrs validator: None (no limit) or a number of seconds in ``(0, MAX_TIMEOUT_S]``."""

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        check_timeout(f"{type(inst).__name__}.{attr.name}", value)

    return check


def int_at_least(low: int) -> Any:
    """An ``int`` (not a bool) ``>= low``."""

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        check_int(f"{type(inst).__name__}.{attr.name}", value, low)

    return check


def int_in(low: int, high: int) -> Any:
    """An ``int`` (not a bool) in ``[low, high]``: a bound that keeps memory and time finite."""

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        check_int(f"{type(inst).__name__}.{attr.name}", value, low, high)

    return check


def float_in(low: float, high: float = math.inf, *, low_open: bool = False) -> Any:
    """A finite number in ``[low, high]`` (``(low, high]`` with ``low_open``); the message
    quotes the range enforced (an infinite end is open: inf itself is rejected)."""
    lo = "(" if low_open or math.isinf(low) else "["
    hi = ")" if math.isinf(high) else "]"

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and (low < value if low_open else low <= value)
        if not (ok and value <= high):
            raise ValueError(
                f"{type(inst).__name__}.{attr.name} must be a finite number in "
                f"{lo}{low}, {high}{hi}, got {value!r}"
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
