"""Columns of a ``DataProto``: 1-D object arrays for non-tensors, and the checks that keep
every column one entry per row (construction, update, union, concat, key lookups), and
the checks on DataProto's other arguments (mappings, slices, devices, concat parts), so a
wrong type fails with a message naming the argument, the value and what to pass.

Nothing here knows DataProto, so ``dataproto.py`` reads as the class's API.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rollpipe.data.proto._equality import values_equal

__all__ = [
    "as_object_column",
    "assign_columns",
    "build_columns",
    "check_fields",
    "check_keys",
    "check_rename",
    "check_same_columns",
    "check_slice",
    "check_union",
    "coerce_columns",
    "column_rows",
    "concat_columns",
    "concat_parts",
    "device_arg",
    "keys_arg",
    "mapping_arg",
    "object_array",
    "object_columns",
    "plain_dicts",
    "short_repr",
]


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr`` cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def object_array(values: Iterable[Any]) -> np.ndarray:
    """A 1-D object array with one element per item, whatever the items are.

    ``np.array(list_of_lists, dtype=object)`` turns equal-length lists into a 2-D array;
    assigning element by element keeps one row per item.
    """
    items = list(values)
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def as_object_column(key: str, value: Any) -> np.ndarray:
    """Coerce a non-tensor column (1-D ndarray, list or tuple) to a 1-D object array."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError(
                f"non-tensor column {key!r} must be a 1-D array (one entry per row), got shape "
                f"{value.shape}; "
                "build it with rollpipe.data.proto.columns.object_array(list_of_rows)"
            )
        return value if value.dtype == object else object_array(value.tolist())
    if isinstance(value, (list, tuple)):
        return object_array(value)
    raise ValueError(
        f"non-tensor column {key!r} must be a numpy array, list or tuple with one entry per "
        f"row, got {short_repr(value)} ({type(value).__name__}); put per-batch values in "
        "meta_info instead"
    )


def keys_arg(keys: str | Iterable[str] | None, what: str) -> list[str] | None:
    """Normalize a key argument: a single string becomes a one-item list."""
    if keys is None:
        return None
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, Iterable):
        raise ValueError(
            f"{what} must be a str, a list of str or None, got {keys!r} ({type(keys).__name__})"
        )
    out = list(keys)
    for k in out:
        if not isinstance(k, str):
            raise ValueError(f"{what} must be strings, got {k!r} ({type(k).__name__})")
    return out


def column_rows(key: str, value: Any) -> tuple[Any, int]:
    """A column value ready to store (non-tensors as object arrays) and its row count."""
    if isinstance(value, TensorDictBase):
        rows = value.batch_size[0] if value.batch_dims else None
    elif isinstance(value, Tensor):
        rows = value.shape[0] if value.dim() else None
    else:
        value = as_object_column(key, value)
        rows = len(value)
    if rows is None:
        raise ValueError(
            f"column {key!r} is 0-d ({short_repr(value)}); a column needs a leading row dimension"
        )
    return value, rows


def check_same_columns(parts: Sequence[tuple[TensorDictBase | None, Mapping[str, Any]]]) -> None:
    """concat's precondition: the same keys in every part, and per tensor key the same dtype
    and trailing shape (``torch.cat`` would otherwise fail with a less helpful message)."""
    ref_batch, ref_cols = parts[0]
    ref_b = set(ref_batch.keys()) if ref_batch is not None else set()
    for i, (batch, cols) in enumerate(parts[1:], start=1):
        got_b = set(batch.keys()) if batch is not None else set()
        for kind, ref, got in (
            ("batch", ref_b, got_b),
            ("non_tensor_batch", set(ref_cols), set(cols)),
        ):
            if ref != got:
                raise ValueError(
                    f"concat part {i} has {kind} keys {sorted(got)} but part 0 has {sorted(ref)} "
                    f"(missing {sorted(ref - got)}, extra {sorted(got - ref)}); select the "
                    "common keys first"
                )
    if ref_batch is None:
        return
    for key, ref_t in ref_batch.items(include_nested=True, leaves_only=True):
        for i, (batch, _) in enumerate(parts[1:], start=1):
            t = batch.get(key)  # type: ignore[union-attr]
            if t.shape[1:] != ref_t.shape[1:] or t.dtype != ref_t.dtype:
                raise ValueError(
                    f"concat: batch key {key!r} is {tuple(t.shape)} {t.dtype} in part {i} but "
                    f"{tuple(ref_t.shape)} {ref_t.dtype} in part 0; all parts must agree on "
                    "dtype and every dimension but the first (pad rows to one length, e.g. "
                    "rollpipe.data.padding.pad_1d(..., length=L))"
                )


def coerce_columns(
    columns: Mapping[str, Any], n: int | None = None
) -> tuple[dict[str, Any], int | None]:
    """``column_rows`` for each column, checking they all have ``n`` rows (if ``n`` is None,
    the first column sets it)."""
    out: dict[str, Any] = {}
    pivot = "the DataProto"
    for key, value in columns.items():
        if not isinstance(key, str):
            raise ValueError(f"column names must be str, got {key!r} ({type(key).__name__})")
        out[key], rows = column_rows(key, value)
        if n is None:
            n, pivot = rows, repr(key)
        elif rows != n:
            raise ValueError(
                f"column {key!r} has {rows} rows but {pivot} has {n}; every column needs one "
                "entry per row"
            )
    return out, n


def check_fields(batch: TensorDictBase | None, columns: Mapping[str, Any], meta: Any) -> None:
    """DataProto's invariants: one batch dim, 1-D object columns, one row count, no key in
    both ``batch`` and ``non_tensor_batch``, a dict meta_info."""
    n: int | None = None
    if batch is not None:
        if batch.batch_dims != 1:
            raise ValueError(
                f"batch must have exactly one batch dimension, got batch_size="
                f"{list(batch.batch_size)}; build it with TensorDict(..., batch_size=[n])"
            )
        n = batch.batch_size[0]
    for key, col in columns.items():
        if not isinstance(col, np.ndarray) or col.dtype != object or col.ndim != 1:
            what = f"shape {col.shape} {col.dtype}" if isinstance(col, np.ndarray) else col
            raise ValueError(
                f"non_tensor_batch[{key!r}] must be a 1-D numpy object array, got "
                f"{short_repr(what)}; "
                "build it with rollpipe.data.proto.columns.object_array(values)"
            )
        if n is not None and len(col) != n:
            raise ValueError(
                f"non_tensor_batch[{key!r}] has {len(col)} rows but the DataProto has {n}; "
                "every column needs one entry per row"
            )
        n = len(col)
        if batch is not None and key in batch:
            raise ValueError(f"key {key!r} is in both batch and non_tensor_batch; keep one")
    if not isinstance(meta, dict):
        raise ValueError(
            f"meta_info must be a dict, got {short_repr(meta)} ({type(meta).__name__})"
        )


def check_union(mine: Mapping[str, Any], theirs: Mapping[str, Any], what: str) -> None:
    """Keys present on both sides of a union must hold equal values."""
    for key, value in theirs.items():
        if key in mine and not values_equal(mine[key], value):
            raise ValueError(
                f"union conflict on {what} {key!r}: {short_repr(mine[key])} vs "
                f"{short_repr(value)}; rename or pop one of them first"
            )


def check_keys(
    batch: TensorDictBase | None,
    columns: Mapping[str, Any],
    meta: Mapping[str, Any],
    wanted: tuple[Sequence[str], Sequence[str], Sequence[str]],
) -> None:
    """The batch, non_tensor_batch and meta_info keys in ``wanted`` all exist, else a
    KeyError saying where the key is (or listing the keys there are)."""
    from rollpipe.data.proto._keys import missing_key

    batch_keys = list(batch.keys()) if batch is not None else []
    parts = {"batch": batch_keys, "non_tensor_batch": list(columns), "meta_info": list(meta)}
    for (kind, have), keys in zip(parts.items(), wanted, strict=True):
        for key in keys:
            if key not in have:
                raise missing_key(key, kind, parts)


def check_rename(old: Sequence[str], new: Sequence[str], present: Sequence[str]) -> None:
    """``rename``'s precondition: pairs of keys, each old key present, no new key taken."""
    if len(old) != len(new):
        raise ValueError(
            f"rename got {len(old)} old_keys {list(old)} but {len(new)} new_keys {list(new)}; "
            "give one new key per old key"
        )
    for o, nk in zip(old, new, strict=True):
        if o not in present:
            raise KeyError(f"cannot rename {o!r}: no such column; columns are {list(present)}")
        if nk != o and nk in present:
            raise ValueError(f"cannot rename {o!r} to {nk!r}: {nk!r} exists; pop it first")


def build_columns(
    tensors: Mapping[str, Any], non_tensors: Mapping[str, Any]
) -> tuple[TensorDict | None, dict[str, np.ndarray]]:
    """``from_dict``'s columns: the tensors as one TensorDict (None when there are none)
    and the rest as object arrays, every column with the same number of rows."""
    for key, value in tensors.items():
        if not isinstance(value, Tensor):
            raise ValueError(
                f"tensors[{key!r}] is a {type(value).__name__}, not a tensor; pass it in "
                "non_tensors (or use DataProto.from_single_dict)"
            )
        if key in non_tensors:
            raise ValueError(f"key {key!r} is in both tensors and non_tensors; keep one")
    checked, n = coerce_columns({**tensors, **non_tensors})
    batch = TensorDict({k: checked[k] for k in tensors}, [n or 0]) if tensors else None
    return batch, {k: checked[k] for k in non_tensors}


def concat_columns(
    parts: Sequence[tuple[TensorDictBase | None, Mapping[str, np.ndarray], int]],
) -> tuple[TensorDictBase | None, dict[str, np.ndarray]]:
    """The rows of ``(batch, columns, num_rows)`` parts, in order (keys must match)."""
    check_same_columns([(batch, cols) for batch, cols, _ in parts])
    columns = {k: np.concatenate([cols[k] for _, cols, _ in parts]) for k in parts[0][1]}
    if all(batch is None for batch, _, _ in parts):
        return None, columns
    tds = [batch if batch is not None else TensorDict({}, [n]) for batch, _, n in parts]
    return TensorDict.cat(tds, dim=0), columns


def assign_columns(
    batch: TensorDictBase | None, columns: dict[str, np.ndarray], values: Mapping[str, Any], n: int
) -> TensorDictBase | None:
    """``update``'s writes: object arrays into ``columns``, tensors into ``batch`` (made for
    ``n`` rows if None); a key whose kind changed moves. Returns the batch."""
    for key, value in values.items():
        if isinstance(value, np.ndarray):
            if batch is not None and key in batch:
                del batch[key]
            columns[key] = value
        else:
            columns.pop(key, None)
            if batch is None:
                batch = TensorDict({}, batch_size=[n])
            batch.set(key, value)
    return batch


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
