"""``freeze``: nested lists, dicts, arrays and tensors as hashable tuples.

Used wherever a config or a column value must key a dict (env pools, ``group_by``) or
compare equal after a round trip through plain data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from torch import Tensor

__all__ = ["freeze", "plain", "thaw"]


def freeze(value: Any, *, mappings: bool = True) -> Any:
    """``value`` with lists, tuples, arrays and tensors turned into (nested) tuples.

    A mapping becomes a key-sorted tuple of ``(key, frozen value)`` pairs; with
    ``mappings=False`` it is left as it is (so a caller can refuse it as unhashable).
    """
    if isinstance(value, (Tensor, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v, mappings=mappings) for v in value)
    if mappings and isinstance(value, Mapping):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    return value


def thaw(value: Any, where: str) -> Any:
    """A frozen value as plain data (tuples -> lists); ``freeze`` of it gives ``value`` back.

    Leaves must be None, bool, int, float or str; anything else raises a ValueError
    naming ``where``, since it could not be saved as plain data.
    """
    if isinstance(value, (list, tuple)):
        return [thaw(v, where) for v in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):  # subclasses (numpy float64) as the plain type
        return int(value) if isinstance(value, int) else float(value)
    raise ValueError(
        f"{where} holds a {type(value).__name__} ({value!r}); checkpoint state keeps only "
        "None, bool, int, float, str and lists of them"
    )


def plain(value: Any, where: str) -> Any:
    """``value`` as plain data that JSON and ``torch.load(weights_only=True)`` read back
    equal: dicts (string keys) and lists of None, bool, int, float and str. Tuples become
    lists and numpy scalars Python ones; anything else raises a ValueError naming ``where``."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a key {k!r} that is not a str")
            out[k] = plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (Tensor, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v, where) for v in value]
    return thaw(value, where)
