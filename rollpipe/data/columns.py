"""Helpers behind ``DataProto``: object columns, value equality, index checks, meta merging,
concat checks and minibatch orders.

Kept apart from ``proto.py`` so the class reads as its API; nothing here knows DataProto.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from torch import Tensor

from rollpipe._utils.seeding import derive_seed

if TYPE_CHECKING:
    from rollpipe.data.proto import DataProto

__all__ = [
    "as_object_column",
    "check_count",
    "check_fields",
    "check_same_columns",
    "check_union",
    "chunk_sizes",
    "coerce_columns",
    "column_rows",
    "group_indices",
    "join_tensordict",
    "keys_arg",
    "merge_meta_info",
    "minibatch_orders",
    "normalize_index",
    "object_array",
    "pad_dataproto_to_divisor",
    "pad_to_divisor",
    "short_repr",
    "split_tensordict",
    "unpad",
    "unpad_dataproto",
    "values_equal",
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
                f"{value.shape}; build it with rollpipe.data.columns.object_array(list_of_rows)"
            )
        return value if value.dtype == object else object_array(value.tolist())
    if isinstance(value, (list, tuple)):
        return object_array(value)
    raise ValueError(
        f"non-tensor column {key!r} must be a numpy array, list or tuple with one entry per "
        f"row, got {type(value).__name__}; put per-batch values in meta_info instead"
    )


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
    """Deep equality for tensors, arrays (object arrays element-wise), mappings and lists.

    NaN equals NaN, so a column that holds NaN still matches itself.
    """
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


def keys_arg(keys: str | Iterable[str] | None, what: str) -> list[str] | None:
    """Normalize a key argument: a single string becomes a one-item list."""
    if keys is None:
        return None
    if isinstance(keys, str):
        return [keys]
    out = list(keys)
    for k in out:
        if not isinstance(k, str):
            raise ValueError(f"{what} must be strings, got {k!r} ({type(k).__name__})")
    return out


def normalize_index(idx: Any, n: int) -> np.ndarray:
    """Row indices (ints, negatives allowed, or a bool mask) as checked int64 positions."""
    if isinstance(idx, Tensor):
        arr = idx.detach().cpu().numpy()
    elif isinstance(idx, np.ndarray):
        arr = idx
    elif isinstance(idx, (list, range)):
        arr = np.asarray(idx) if len(idx) else np.zeros(0, dtype=np.int64)
    else:
        raise IndexError(
            f"cannot index rows with {type(idx).__name__}; use an int, a slice, a list / numpy "
            "array / tensor of ints, a bool mask, or a column name"
        )
    if arr.ndim != 1:
        raise IndexError(f"row indices must be 1-D, got shape {arr.shape}; flatten them first")
    if arr.dtype == bool:
        if arr.shape[0] != n:
            raise IndexError(
                f"bool mask has {arr.shape[0]} entries but the DataProto has {n} rows; "
                "pass exactly one entry per row"
            )
        return np.flatnonzero(arr).astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise IndexError(f"row indices must be integers or bools, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < -n) | (arr >= n)
    if bad.any():
        raise IndexError(
            f"row index {int(arr[bad][0])} is out of range for a DataProto with {n} rows "
            f"(valid indices are -{n}..{n - 1})"
        )
    return np.where(arr < 0, arr + n, arr)


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """Validate an integer argument such as ``chunks`` or ``batch_size``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def chunk_sizes(n: int, chunks: int) -> list[int]:
    """Sizes of ``chunks`` pieces of ``n`` rows, as ``numpy.array_split`` makes them."""
    chunks = check_count(chunks, "chunks")
    if chunks > n:
        raise ValueError(
            f"cannot split {n} rows into {chunks} chunks (more chunks than rows); use at most "
            f"{n} chunks or pad first with rollpipe.data.proto.pad_to_divisor(dp, {chunks})"
        )
    base, extra = divmod(n, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def _freeze(value: Any) -> Any:
    """Lists, arrays and tensors as (nested) tuples, so they can be dict keys."""
    if isinstance(value, (Tensor, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _hashable(value: Any, key: str, row: int) -> Hashable:
    value = _freeze(value)
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            f"group_by key {key!r} holds an unhashable {type(value).__name__} at row {row}; "
            "group by a column of strings or numbers"
        ) from None
    return value


def group_indices(columns: Mapping[str, Sequence[Any]], n: int) -> dict[Any, list[int]]:
    """Row positions per distinct key value (a tuple for several keys), first-seen order."""
    names = list(columns)
    groups: dict[Any, list[int]] = {}
    per_key = [columns[k] for k in names]
    for row in range(n):
        parts = [_hashable(col[row], name, row) for name, col in zip(names, per_key, strict=True)]
        group = parts[0] if len(parts) == 1 else tuple(parts)
        groups.setdefault(group, []).append(row)
    return groups


def merge_meta_info(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the meta_info of concatenated parts.

    ``metrics`` (a dict of values, or a list of such dicts, per part) becomes one dict of
    lists: list values are extended, scalars appended. Any other key must be equal in all
    parts that hold it.
    """
    merged: dict[str, Any] = {}
    first_part: dict[str, int] = {}
    metrics: dict[str, list[Any]] | None = None
    for i, meta in enumerate(metas):
        for key, value in meta.items():
            if key == "metrics":
                if value is None:
                    continue
                if metrics is None:
                    metrics = merged["metrics"] = {}
                for entry in value if isinstance(value, list) else [value]:
                    if not isinstance(entry, Mapping):
                        raise ValueError(
                            f"meta_info['metrics'] of part {i} must be a dict of metric values "
                            f"(or a list of dicts), got {short_repr(entry)}"
                        )
                    for name, v in entry.items():
                        bucket = metrics.setdefault(name, [])
                        bucket.extend(v) if isinstance(v, list) else bucket.append(v)
            elif key not in merged:
                merged[key] = value
                first_part[key] = i
            elif not values_equal(merged[key], value):
                raise ValueError(
                    f"meta_info key {key!r} conflicts: part {first_part[key]} has "
                    f"{short_repr(merged[key])} but part {i} has {short_repr(value)}; make the "
                    "values equal or pop the key before concat"
                )
    return merged


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
        raise ValueError(f"column {key!r} is 0-d; a column needs a leading row dimension")
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


def split_tensordict(td: TensorDictBase) -> tuple[list[str], dict[str, np.ndarray], dict[str, Any]]:
    """Tensor keys, NonTensorStack columns (as object arrays) and NonTensorData values of td."""
    if td.batch_dims != 1:
        raise ValueError(
            f"from_tensordict needs a TensorDict with one batch dimension, got batch_size="
            f"{list(td.batch_size)}; set batch_size=[num_rows]"
        )
    tensor_keys: list[str] = []
    columns: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    for key, value in td.items():
        if isinstance(value, NonTensorStack):
            columns[key] = object_array(value.tolist())
        elif isinstance(value, NonTensorData):
            meta[key] = value.data
        else:
            tensor_keys.append(key)
    return tensor_keys, columns, meta


def minibatch_orders(
    n: int, size: int, shuffle: bool, seed: int, epochs: int, drop_last: bool
) -> Iterator[np.ndarray]:
    """Row positions of each minibatch; epoch ``e`` shuffles with ``derive_seed(seed, e)``."""
    stop = n - n % size if drop_last else n
    for epoch in range(epochs):
        order = np.arange(n)
        if shuffle:
            order = np.random.default_rng(derive_seed(seed, epoch)).permutation(n)
        for start in range(0, stop, size):
            yield order[start : start + size]


def coerce_columns(
    columns: Mapping[str, Any], n: int | None = None
) -> tuple[dict[str, Any], int | None]:
    """``column_rows`` for each column, checking they all have ``n`` rows (if ``n`` is None,
    the first column sets it)."""
    out: dict[str, Any] = {}
    pivot = "the DataProto"
    for key, value in columns.items():
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
                f"{short_repr(what)}; build it with rollpipe.data.columns.object_array(values)"
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
        raise ValueError(f"meta_info must be a dict, got {type(meta).__name__}")


def check_union(mine: Mapping[str, Any], theirs: Mapping[str, Any], what: str) -> None:
    """Keys present on both sides of a union must hold equal values."""
    for key, value in theirs.items():
        if key in mine and not values_equal(mine[key], value):
            raise ValueError(
                f"union conflict on {what} {key!r}: {short_repr(mine[key])} vs "
                f"{short_repr(value)}; rename or pop one of them first"
            )


def join_tensordict(
    batch: TensorDictBase | None, columns: Mapping[str, np.ndarray], meta: Mapping[str, Any], n: int
) -> TensorDictBase:
    """One TensorDict as verl lays it out: tensors, columns as NonTensorStack, meta_info
    entries as NonTensorData (the inverse of ``split_tensordict``)."""
    td = batch.copy() if batch is not None else TensorDict({}, batch_size=[n])
    for key, col in columns.items():
        td.set(key, NonTensorStack.from_list(list(col)))
    for key, value in meta.items():
        if key in td:
            raise ValueError(f"meta_info key {key!r} is also a column; rename one of them")
        td.set_non_tensor(key, value)
    return td


def pad_to_divisor(dp: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``dp`` to a multiple of ``size_divisor`` rows by repeating rows from the start
    (as verl); returns ``(padded, pad_size)``."""
    k = check_count(size_divisor, "size_divisor")
    n = len(dp)
    pad_size = (-n) % k
    if pad_size == 0:
        return dp, 0
    padded = type(dp).concat([dp, dp.select_idxs(np.arange(pad_size) % n)])
    padded.meta_info = dict(dp.meta_info)  # not merged: metrics would be counted twice
    return padded, pad_size


def unpad(dp: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows that ``pad_to_divisor`` added."""
    pad = check_count(pad_size, "pad_size", minimum=0)
    if pad > len(dp):
        raise ValueError(f"pad_size={pad} is larger than the DataProto's {len(dp)} rows")
    return dp.slice(0, len(dp) - pad) if pad else dp


pad_dataproto_to_divisor = pad_to_divisor  # the verl / ROLL names
unpad_dataproto = unpad
