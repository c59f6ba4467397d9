"""Row positions behind DataProto's row operations: checked indices and counts, chunk
sizes, group_by's groups, repeat counts and seeded minibatch orders."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch import Tensor

from rollpipe._utils.checks import check_int
from rollpipe._utils.freeze import freeze
from rollpipe._utils.seeding import derive_seed
from rollpipe.data.proto.columns import short_repr

__all__ = [
    "check_count",
    "check_permutation",
    "chunk_sizes",
    "group_indices",
    "minibatch_orders",
    "normalize_index",
    "repeat_counts",
]


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """An int argument such as ``chunks`` or ``batch_size`` (numpy ints accepted)."""
    return check_int(name, int(value) if isinstance(value, np.integer) else value, minimum)


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
            f"cannot index rows with {short_repr(idx)} ({type(idx).__name__}); use an int, a "
            "slice, a list / numpy array / tensor of ints, a bool mask, or a column name"
        )
    if arr.ndim != 1:
        raise IndexError(
            f"row indices must be 1-D, got shape {arr.shape}: {short_repr(arr.tolist())}; "
            "flatten them first"
        )
    if arr.dtype == bool:
        if arr.shape[0] != n:
            raise IndexError(
                f"bool mask has {arr.shape[0]} entries but the DataProto has {n} rows; "
                "pass exactly one entry per row"
            )
        return np.flatnonzero(arr).astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise IndexError(
            f"row indices must be integers or bools, got {short_repr(arr.tolist())} "
            f"(dtype {arr.dtype})"
        )
    arr = arr.astype(np.int64)
    bad = (arr < -n) | (arr >= n)
    if bad.any():
        raise IndexError(
            f"row index {int(arr[bad][0])} is out of range for a DataProto with {n} rows "
            f"(valid indices are -{n}..{n - 1})"
        )
    return np.where(arr < 0, arr + n, arr)


def check_permutation(idx: np.ndarray, n: int) -> np.ndarray:
    """``idx`` if it is a permutation of ``n`` rows (for ``reorder``)."""
    distinct = len(np.unique(idx))
    if len(idx) != n or distinct != n:
        raise ValueError(
            f"reorder needs a permutation of all {n} rows, got {len(idx)} indices "
            f"with {distinct} distinct ({short_repr(np.asarray(idx).tolist())}); use "
            "select_idxs to pick or repeat rows"
        )
    return idx


def repeat_counts(repeat_times: Sequence[int] | np.ndarray | Tensor, n: int) -> np.ndarray:
    """One non-negative int64 count per row (for ``sample_level_repeat``)."""
    raw = repeat_times.cpu().numpy() if isinstance(repeat_times, Tensor) else repeat_times
    if not isinstance(raw, (Sequence, np.ndarray)) or isinstance(raw, str):
        raise ValueError(
            f"sample_level_repeat needs one int count per row (a list, array or tensor), got "
            f"{short_repr(raw)}"
        )
    counts = np.asarray(raw) if len(raw) else np.zeros(0, dtype=np.int64)
    if counts.ndim != 1 or len(counts) != n:
        raise ValueError(
            f"sample_level_repeat needs one count per row: got {counts.size} counts for {n} rows"
        )
    if len(counts) and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
        raise ValueError(f"repeat counts must be non-negative ints, got {short_repr(counts)}")
    return counts.astype(np.int64)


def chunk_sizes(n: int, chunks: int) -> list[int]:
    """Sizes of ``chunks`` pieces of ``n`` rows, as ``numpy.array_split`` makes them."""
    chunks = check_count(chunks, "chunks")
    if chunks > n:
        raise ValueError(
            f"cannot split {n} rows into {chunks} chunks (more chunks than rows); use at most "
            f"{n} chunks or pad first with rollpipe.pad_to_divisor(dp, {chunks})"
        )
    base, extra = divmod(n, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def _hashable(value: Any, key: str, row: int) -> Hashable:
    # dicts are refused, not frozen: a group key should read like the column's values
    value = freeze(value, mappings=False)
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            f"group_by key {key!r} holds an unhashable {type(value).__name__} at row {row}; "
            "group by a column of strings or numbers"
        ) from None
    return value


def group_indices(columns: Mapping[str, Sequence[Any] | Tensor], n: int) -> dict[Any, list[int]]:
    """Row positions per distinct key value (a tuple for several keys), first-seen order."""
    names = list(columns)
    groups: dict[Any, list[int]] = {}
    per_key = [c.tolist() if isinstance(c, Tensor) else c for c in columns.values()]
    for row in range(n):
        parts = [_hashable(col[row], name, row) for name, col in zip(names, per_key, strict=True)]
        group = parts[0] if len(parts) == 1 else tuple(parts)
        groups.setdefault(group, []).append(row)
    return groups


def minibatch_orders(
    n: int, batch_size: int, shuffle: bool, seed: int, epochs: int, drop_last: bool
) -> Iterator[np.ndarray]:
    """Row positions of each minibatch; epoch ``e`` shuffles with ``derive_seed(seed, e)``.

    The arguments are checked now, not at the first ``next()``.
    """
    size = check_count(batch_size, "batch_size")
    epochs = check_count(epochs, "epochs")
    if drop_last and size > n:
        raise ValueError(
            f"batch_size={size} is larger than the {n} rows, so drop_last=True "
            "would yield nothing; lower batch_size or set drop_last=False"
        )
    derive_seed(seed)
    return _orders(n, size, shuffle, seed, epochs, n - n % size if drop_last else n)


def _orders(
    n: int, size: int, shuffle: bool, seed: int, epochs: int, stop: int
) -> Iterator[np.ndarray]:
    for epoch in range(epochs):
        order = np.arange(n)
        if shuffle:
            order = np.random.default_rng(derive_seed(seed, epoch)).permutation(n)
        for start in range(0, stop, size):
            yield order[start : start + size]
