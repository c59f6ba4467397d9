"""Pickling and disk I/O of a ``DataProto``: its tensors travel as one consolidated buffer.

Nothing here knows ``DataProto`` (the class is passed in), so ``dataproto.py`` reads as its API.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from tensordict import TensorDictBase

__all__ = ["load_checked", "pickled_state", "save_checked"]


def pickled_state(
    batch: TensorDictBase | None, columns: dict[str, Any], meta: dict[str, Any]
) -> dict[str, Any]:
    """The state to pickle: the tensors consolidated into one storage (copied once)."""
    return {
        "batch": batch.consolidate() if batch is not None else None,
        "non_tensor_batch": columns,
        "meta_info": meta,
    }


def _check_path(path: Any, call: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(
            f"DataProto.{call}: path must be a str or os.PathLike, got {path!r} "
            f"({type(path).__name__})"
        )


def save_checked(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``; a bad path or a missing folder is a ValueError naming it."""
    _check_path(path, "save")
    try:
        torch.save(obj, path)
    except (OSError, RuntimeError) as exc:
        raise ValueError(
            f"DataProto.save: cannot write {os.fspath(path)!r} ({exc}); create its folder "
            "first or pick a writable path"
        ) from exc


def load_checked(
    path: str | os.PathLike[str], map_location: torch.device | str | None, cls: type
) -> Any:
    """``torch.load`` of ``path``, which must hold a ``cls`` (ValueError otherwise, also for
    a truncated, corrupted or empty file)."""
    _check_path(path, "load")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=False)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as exc:  # torch/pickle raise many types for a damaged file
        size = os.path.getsize(path)
        raise ValueError(
            f"DataProto.load: {os.fspath(path)!r} ({size} bytes) is not a readable DataProto "
            f"file: it is truncated, corrupted or was not written by DataProto.save "
            f"({type(exc).__name__}: {str(exc)[:120]}); save it again from the source"
        ) from exc
    if not isinstance(obj, cls):
        raise ValueError(f"{os.fspath(path)!r} holds a {type(obj).__name__}, not a {cls.__name__}")
    return obj
