"""Checks on DataProto's arguments, so a wrong type fails with a message naming the
argument, the value and what to pass, instead of a bare TypeError from deep inside."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rollpipe.data.proto.columns import as_object_column, short_repr

__all__ = [
    "check_slice",
    "concat_parts",
    "device_arg",
    "mapping_arg",
    "object_columns",
    "plain_dicts",
]


def mapping_arg(
    value: Any, what: str, hint: str = "a dict (or None)", allow_none: bool = True
) -> Mapping[str, Any]:
    """``value`` if it is a mapping (None: empty), else a ValueError naming ``what``."""
    if value is None and allow_none:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be {hint}, got {short_repr(value)} ({type(value).__name__})")
    return value


def plain_dicts(**named: Any) -> list[dict[str, Any]]:
    """Each named argument as a plain dict (None: empty), checked to be a mapping."""
    return [dict(mapping_arg(value, name)) for name, value in named.items()]


def object_columns(value: Any) -> dict[str, Any]:
    """``non_tensor_batch`` as 1-D object arrays, one per column."""
    columns = mapping_arg(value, "non_tensor_batch")
    return {k: as_object_column(k, v) for k, v in columns.items()}


def concat_parts(data: Any, cls: type) -> list[Any]:
    """``concat``'s argument as a non-empty list of ``cls`` (DataProto) instances."""
    if isinstance(data, cls) or not isinstance(data, Iterable) or isinstance(data, str):
        raise ValueError(
            f"concat needs a list of DataProto, got {short_repr(data)} ({type(data).__name__}); "
            "write DataProto.concat([a, b])"
        )
    parts = list(data)
    if not parts:
        raise ValueError("concat needs at least one DataProto, got an empty list")
    for i, part in enumerate(parts):
        if not isinstance(part, cls):
            raise ValueError(
                f"concat part {i} is a {type(part).__name__}, not a DataProto: {short_repr(part)}"
            )
    return parts


def check_slice(start: Any, end: Any, step: Any) -> None:
    """Slice bounds are ints or None (numpy ints too)."""
    for name, value in (("start", start), ("end", end), ("step", step)):
        ok = value is None or (hasattr(value, "__index__") and not isinstance(value, bool))
        if not ok:
            raise IndexError(f"slice {name} must be an int or None, got {short_repr(value)}")


def device_arg(device: Any) -> torch.device:
    """``device`` as a ``torch.device``, or a ValueError saying what a device looks like."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"to: {short_repr(device)} is not a device; use e.g. 'cpu', 'cuda:0' or a "
            f"torch.device ({exc})"
        ) from None
