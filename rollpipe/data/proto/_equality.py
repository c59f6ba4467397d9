"""``values_equal``: deep equality of DataProto values (tensors, arrays, mappings, lists).

NaN equals NaN, so a column that holds NaN still matches itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import Tensor

__all__ = ["values_equal"]


def _tensor_equal(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        return bool(same.all())
    return torch.equal(a, b)


def values_equal(a: Any, b: Any) -> bool:
    """Deep equality for tensors, arrays (object arrays element-wise), mappings and lists."""
    if a is b:
        return True
    if isinstance(a, TensorDictBase) or isinstance(b, TensorDictBase):
        if not (isinstance(a, TensorDictBase) and isinstance(b, TensorDictBase)):
            return False
        keys = set(a.keys(include_nested=True, leaves_only=True))
        if a.batch_size != b.batch_size or keys != set(b.keys(True, True)):
            return False
        return all(values_equal(a.get(k), b.get(k)) for k in keys)
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and _tensor_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # both NaN
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False
