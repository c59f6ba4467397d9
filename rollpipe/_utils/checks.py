"""attrs validators shared by rollpipe's frozen configs and records.

Every message names the class and field, the bad value, and the accepted range.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = ["float_in", "int_at_least", "optional"]

optional = attrs.validators.optional


def int_at_least(low: int) -> Any:
    """An ``int`` (not a bool) ``>= low``."""

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(
                f"{type(inst).__name__}.{attr.name} must be an int >= {low}, got {value!r}"
            )

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
