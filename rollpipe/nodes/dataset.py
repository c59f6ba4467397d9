"""Prompt datasets: the rows a run draws its groups from, and the order it visits them.

Each group is one row (all its members share it, as GRPO's ``n`` samples of one prompt).
The order is a pure function of the seed and the group's position: group ``g`` is row
``order(epoch)[g % N]`` of epoch ``g // N``, each epoch a fresh permutation drawn from the
seed (or ``0..N-1`` with ``shuffle=False``). So the episode source's group counter is the
whole position: a resumed run continues the same pass, no row skipped or repeated, and a
validation pass (``shuffle=False``, one epoch) is the same every time.

Rows come from a sequence (a list, a ``datasets.Dataset``: anything with ``len`` and
integer indexing), a JSON-lines / JSON file, an import path ``"pkg.module:rows"`` (the
object, or a function returning it: resolvable in any process, a Ray actor included), or
an iterable without random access (streamed in order; ``shuffle`` needs random access).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from rollpipe._utils.checks import int_at_least, optional
from rollpipe._utils.import_path import NotAnImportPath, import_object
from rollpipe._utils.seeding import derive_seed

__all__ = ["DatasetSettings", "RowOrder", "load_rows"]

_HINT = (
    "give a list of rows, a datasets.Dataset, a path to a .jsonl/.json file, an import path "
    "'package.module:rows' (the rows or a function returning them), or an iterable"
)


def load_rows(value: Any) -> Sequence[Any] | Iterable[Any]:
    """``value`` as rows: a sequence as it is, a file or an import path resolved."""
    if isinstance(value, (str, Path)):
        text = str(value)
        if text.endswith((".jsonl", ".json")):
            return _read_json(Path(text))
        try:
            value = import_object(text)
        except NotAnImportPath:
            raise ValueError(
                f"DatasetSettings.rows: {text!r} is not a file or an import path; {_HINT}"
            ) from None
        except Exception as exc:
            raise ValueError(
                f"DatasetSettings.rows: cannot import {text!r} "
                f"({type(exc).__name__}: {exc}); {_HINT}"
            ) from exc
        if callable(value) and not isinstance(value, type):
            value = value()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"DatasetSettings.rows: got a {type(value).__name__}; {_HINT}")
    return value


def _read_json(path: Path) -> list[Any]:
    if not path.is_file():
        raise ValueError(f"DatasetSettings.rows: no file {str(path)!r}; {_HINT}")
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"DatasetSettings.rows: {str(path)!r} must hold a JSON list of rows")
        return rows
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"DatasetSettings.rows: {str(path)!r} line {n}: {exc}") from None
    return rows


def _random_access(rows: Any) -> bool:
    return hasattr(rows, "__len__") and hasattr(rows, "__getitem__")


def _rows(value: Any) -> Sequence[Any] | Iterable[Any]:
    rows = load_rows(value)
    if _random_access(rows) and len(rows) == 0:  # type: ignore[arg-type]
        raise ValueError("DatasetSettings.rows: the dataset has no rows")
    return rows


@attrs.frozen(kw_only=True)
class DatasetSettings:
    """Where a source's rows come from and how a run visits them (``SourceSettings.dataset``).

    ``rows``: see the module doc. ``shuffle``: a fresh seeded permutation per epoch
    (False: file order). ``epochs``: passes over the rows (None: endless); the source stops
    after them unless ``num_groups`` stops it first.

    Examples:
        >>> rows = [{"question": "1+1"}, {"question": "2+3"}, {"question": "4+4"}]
        >>> settings = DatasetSettings(rows=rows, epochs=2)
        >>> settings.num_rows, settings.num_groups, settings.shuffle
        (3, 6, True)
        >>> order = RowOrder(DatasetSettings.validation(rows), seed=0)  # in order, one pass
        >>> [order.row(group) for group in (0, 2, 3)]
        [(0, {'question': '1+1'}), (2, {'question': '4+4'}), None]
        >>> DatasetSettings(rows=iter(rows))
        Traceback (most recent call last):
        ...
        ValueError: DatasetSettings.shuffle=True needs rows with len() and indexing, ...
    """

    rows: Any = attrs.field(converter=_rows, hash=False)
    shuffle: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    epochs: int | None = attrs.field(
        default=1,
        validator=optional(int_at_least(1)),  # type: ignore[arg-type]
    )

    def __attrs_post_init__(self) -> None:
        if self.shuffle and not _random_access(self.rows):
            raise ValueError(
                f"DatasetSettings.shuffle=True needs rows with len() and indexing, got a "
                f"{type(self.rows).__name__}; pass shuffle=False to stream it in order, or "
                "materialize it (list(rows), datasets.Dataset)"
            )

    @classmethod
    def validation(cls, rows: Any) -> DatasetSettings:
        """One ordered pass over ``rows``: the same groups every time it runs."""
        return cls(rows=rows, shuffle=False, epochs=1)

    @property
    def num_rows(self) -> int | None:
        """Rows per epoch (None for a streamed iterable, until it ends)."""
        return len(self.rows) if _random_access(self.rows) else None

    @property
    def num_groups(self) -> int | None:
        """Groups in all of the epochs (None: endless or not known up front)."""
        n = self.num_rows
        return None if n is None or self.epochs is None else n * self.epochs


class RowOrder:
    """Group position -> (row index, row), for one dataset and seed.

    Random-access rows are looked up in O(1) (one permutation per epoch, cached); a
    streamed iterable is read forward only, so ``row(g)`` must be asked in increasing
    ``g`` (the source does), and a resume at ``g`` reads and skips the first ``g`` rows.
    """

    def __init__(self, settings: DatasetSettings, seed: int) -> None:
        self.settings = settings
        self.seed = seed
        self._perm: tuple[int, np.ndarray] | None = None  # (epoch, permutation)
        self._stream: Iterator[Any] | None = None
        self._streamed = 0  # rows read from the stream (all epochs)
        self._epoch_rows: int | None = None  # a stream's length, once an epoch ended

    def finished(self, group: int) -> bool:
        """Whether ``group`` lies past the last epoch."""
        epochs = self.settings.epochs
        n = self.settings.num_rows or self._epoch_rows
        return epochs is not None and n is not None and group >= n * epochs

    def index(self, group: int) -> int:
        """The row index of ``group`` in its epoch (random-access rows only)."""
        n = self.settings.num_rows
        assert n is not None
        epoch, pos = divmod(group, n)
        if not self.settings.shuffle:
            return pos
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng(derive_seed(self.seed, epoch, 2))
            self._perm = (epoch, rng.permutation(n))
        return int(self._perm[1][pos])

    def row(self, group: int) -> tuple[int, Any] | None:
        """``(index, row)`` of ``group``, or None when the epochs are done."""
        if self.finished(group):
            return None
        if self.settings.num_rows is not None:
            i = self.index(group)
            return i, self.settings.rows[i]
        return self._streamed_row(group)

    def _streamed_row(self, group: int) -> tuple[int, Any] | None:
        if self._stream is None or group < self._streamed:
            self._stream, self._streamed = iter(self.settings.rows), 0
        while True:
            try:
                item = next(self._stream)
            except StopIteration:
                if self._streamed == 0 or iter(self.settings.rows) is self.settings.rows:
                    return None  # empty, or a one-shot iterator: no further epoch
                self._epoch_rows = self._epoch_rows or self._streamed
                if self.finished(self._streamed):
                    return None
                self._stream = iter(self.settings.rows)  # the next epoch
                continue
            self._streamed += 1
            if self._streamed - 1 == group:
                n = self._epoch_rows
                return (group if n is None else group % n), item
