"""Pickling and disk I/O of a ``DataProto``: its tensors travel as one consolidated buffer.

Nothing here knows ``DataProto`` (the class is passed in), so ``proto.py`` reads as its API.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from tensordict import TensorDictBase

__all__ = ["load_checked", "pickled_state"]


def pickled_state(
    batch: TensorDictBase | None, columns: dict[str, Any], meta: dict[str, Any]
) -> dict[str, Any]:
    """The state to pickle: the tensors consolidated into one storage (copied once)."""
    return {
        "batch": batch.consolidate() if batch is not None else None,
        "non_tensor_batch": columns,
        "meta_info": meta,
    }


def load_checked(
    path: str | os.PathLike[str], map_location: torch.device | str | None, cls: type
) -> Any:
    """``torch.load`` of ``path``, which must hold a ``cls`` (ValueError otherwise)."""
    obj = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(obj, cls):
        raise ValueError(f"{os.fspath(path)!r} holds a {type(obj).__name__}, not a {cls.__name__}")
    return obj
