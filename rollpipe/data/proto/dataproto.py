"""``DataProto``: the rollout batch type of verl and ROLL, so trainers written for them read ours.

A DataProto holds ``batch`` (a ``TensorDict`` with one batch dimension, or None when there
are no tensors), ``non_tensor_batch`` (1-D numpy object arrays, one entry per row) and
``meta_info`` (a dict for the whole batch). Row operations keep all columns aligned; invalid
calls raise ``ValueError`` / ``KeyError`` / ``IndexError`` naming the key and the sizes.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rollpipe.data.proto._equality import values_equal
from rollpipe.data.proto._indexing import (
    check_count,
    check_permutation,
    chunk_sizes,
    group_indices,
    minibatch_orders,
    normalize_index,
    repeat_counts,
)
from rollpipe.data.proto._keys import NonTensorColumns, current_name, missing_key
from rollpipe.data.proto._meta import merge_meta_info
from rollpipe.data.proto._persist import load_checked, pickled_state, save_checked
from rollpipe.data.proto._tensordicts import join_tensordict, split_tensordict
from rollpipe.data.proto.columns import (
    assign_columns,
    build_columns,
    check_fields,
    check_keys,
    check_rename,
    check_slice,
    check_union,
    coerce_columns,
    concat_columns,
    concat_parts,
    device_arg,
    keys_arg,
    mapping_arg,
    object_columns,
    plain_dicts,
    short_repr,
)

__all__ = ["DataProto"]

KeysArg = str | Iterable[str] | None


class DataProto:
    """Rows of tensors and Python objects plus batch-level ``meta_info`` (verl/ROLL layout).

    The batch type rollpipe hands out (``trajectory_rows``, ``step_rows``, the pipeline's
    batches) and the one verl's and ROLL's trainers read. It holds three parts:

    * ``batch``: a ``tensordict.TensorDict`` with one batch dimension, the rows
      (``input_ids``, ``attention_mask``, ``scores``, ...), or None when there are no
      tensor columns;
    * ``non_tensor_batch``: a dict of 1-D numpy object arrays, one Python value per row
      (``uid``, ``tags``, ``step_scores``, ...);
    * ``meta_info``: a dict of values for the whole batch (``metrics``, settings).

    The three attributes, the constructor and the operations verl's
    ``verl.protocol.DataProto`` has (``from_dict``, ``select``, ``pop``, ``union``,
    ``concat``, ``chunk``, ``repeat``, ``reorder``, ``to``, ...) have verl's names and
    meaning, so trainer code written for verl's class (or ROLL's, adapted from it)
    reads these batches; ``to_verl`` builds a real verl DataProto, ``to_roll`` ROLL's
    agentic layout. ``len(batch)`` counts the rows, ``batch[int | slice | indices | mask]``
    takes rows and ``batch[name]`` a column; every row operation keeps all columns
    aligned, and an invalid call raises ValueError / KeyError / IndexError naming the key
    and the sizes.

    Examples:
        >>> batch = DataProto.from_dict(
        ...     tensors={"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]])},
        ...     non_tensors={"uid": ["g0", "g1"]},
        ...     meta_info={"temperature": 1.0},
        ... )
        >>> batch
        DataProto(len=2, batch={'input_ids': ((2, 3), torch.int64)}, non_tensor_batch=['uid'],
                  meta_info=['temperature'])
        >>> batch[1]["input_ids"], batch["uid"], batch.meta_info
        (tensor([[4, 5, 0]]), array(['g0', 'g1'], dtype=object), {'temperature': 1.0})
    """

    def __init__(
        self,
        batch: TensorDictBase | None = None,
        non_tensor_batch: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> None:
        if batch is not None and not isinstance(batch, TensorDictBase):
            raise ValueError(
                f"batch must be a tensordict.TensorDict or None, got {type(batch).__name__} "
                f"{short_repr(batch)}; use DataProto.from_dict(tensors=...) to build one from a "
                "dict of tensors"
            )
        self.batch: TensorDictBase | None = batch
        self.non_tensor_batch = object_columns(non_tensor_batch)
        self.meta_info: dict[str, Any] = dict(mapping_arg(meta_info, "meta_info"))
        self.check_consistency()

    @property
    def non_tensor_batch(self) -> dict[str, np.ndarray]:
        """The non-tensor columns (1-D object arrays). A dict; a missing key's KeyError
        says where the key is, and a renamed column reads under its old name with a
        DeprecationWarning (``docs/changes.md``).

        Examples:
            >>> batch = DataProto.from_dict({"x": torch.zeros(2)}, {"uid": ["a", "b"]})
            >>> batch.non_tensor_batch["uid"]
            array(['a', 'b'], dtype=object)
            >>> batch.non_tensor_batch["x"]
            Traceback (most recent call last):
            ...
            KeyError: "non_tensor_batch key 'x' not found: 'x' is in batch.batch (a tensor), ..."
        """
        return self._non_tensor_batch

    @non_tensor_batch.setter
    def non_tensor_batch(self, columns: Mapping[str, np.ndarray]) -> None:
        self._non_tensor_batch = NonTensorColumns(columns, self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (``__getstate__``'s three parts; older pickles hold the same)."""
        self.batch = state["batch"]
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> DataProto:
        """Build from tensors (first dim = rows) and per-row non-tensor sequences.

        Examples:
            >>> batch = DataProto.from_dict(
            ...     tensors={"input_ids": torch.ones(2, 3, dtype=torch.long)},
            ...     non_tensors={"uid": ["g0", "g0"]},
            ...     meta_info={"step": 3},
            ... )
            >>> len(batch), batch.keys(), batch.meta_info
            (2, ['input_ids', 'uid'], {'step': 3})
        """
        batch, columns = build_columns(*plain_dicts(tensors=tensors, non_tensors=non_tensors))
        return cls(batch=batch, non_tensor_batch=columns, meta_info=meta_info)

    @classmethod
    def from_single_dict(
        cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None
    ) -> DataProto:
        """Build from one dict: tensors go to ``batch``, arrays/lists to ``non_tensor_batch``.

        Examples:
            >>> batch = DataProto.from_single_dict({"x": torch.zeros(2, 3), "uid": ["a", "b"]})
            >>> batch.batch["x"].shape, batch.non_tensor_batch["uid"]
            (torch.Size([2, 3]), array(['a', 'b'], dtype=object))
        """
        data = mapping_arg(data, "from_single_dict: data", "a dict of columns", False)
        tensors = {k: v for k, v in data.items() if isinstance(v, Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, Tensor)}
        return cls.from_dict(tensors=tensors, non_tensors=others, meta_info=meta_info)

    @classmethod
    def from_tensordict(
        cls, td: TensorDictBase, meta_info: Mapping[str, Any] | None = None
    ) -> DataProto:
        """Inverse of ``to_tensordict``: tensors -> batch, NonTensorStack -> columns,
        NonTensorData -> meta_info (added to ``meta_info``).

        Examples:
            >>> batch = DataProto.from_dict(
            ...     {"x": torch.arange(2)}, non_tensors={"uid": ["a", "b"]}, meta_info={"k": 1}
            ... )
            >>> back = DataProto.from_tensordict(batch.to_tensordict())
            >>> back.keys(), back.meta_info, back.equals(batch)
            (['x', 'uid'], {'k': 1}, True)
        """
        tensor_keys, columns, meta = split_tensordict(td)
        batch = td.select(*tensor_keys) if tensor_keys or not columns else None
        return cls(batch=batch, non_tensor_batch=columns, meta_info={**(meta_info or {}), **meta})

    def to_tensordict(self) -> TensorDictBase:
        """One TensorDict as verl lays it out: tensors, non-tensor columns as NonTensorStack,
        meta_info entries as NonTensorData.

        Examples:
            >>> batch = DataProto.from_dict(
            ...     {"x": torch.arange(2)}, non_tensors={"uid": ["a", "b"]}, meta_info={"k": 1}
            ... )
            >>> td = batch.to_tensordict()
            >>> td.batch_size, sorted(td.keys()), td["x"], td["k"]
            (torch.Size([2]), ['k', 'uid', 'x'], tensor([0, 1]), 1)
        """
        return join_tensordict(self.batch, self.non_tensor_batch, self.meta_info, len(self))

    # ----------------------------------------------------------------- invariants
    def check_consistency(self) -> None:
        """Raise ValueError unless: one batch dim, 1-D object columns, one row count, no key
        in both ``batch`` and ``non_tensor_batch``, dict meta_info.

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.zeros(2)})
            >>> batch.non_tensor_batch["uid"] = np.array(["a"], dtype=object)  # 1 entry, 2 rows
            >>> batch.check_consistency()
            Traceback (most recent call last):
            ...
            ValueError: non_tensor_batch['uid'] has 1 rows but the DataProto has 2; ...
        """
        check_fields(self.batch, self.non_tensor_batch, self.meta_info)

    # ----------------------------------------------------------------- basics
    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        return len(next(iter(self.non_tensor_batch.values()))) if self.non_tensor_batch else 0

    def keys(self) -> list[str]:
        """All column names: batch keys, then non-tensor keys.

        Examples:
            >>> batch = DataProto.from_dict(
            ...     tensors={"x": torch.zeros(1)}, non_tensors={"uid": ["a"]}, meta_info={"k": 1}
            ... )
            >>> batch.keys(), "uid" in batch, "k" in batch  # meta_info keys are not columns
            (['x', 'uid'], True, False)
        """
        batch_keys = list(self.batch.keys()) if self.batch is not None else []
        return batch_keys + list(self.non_tensor_batch)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return (self.batch is not None and key in self.batch) or key in self.non_tensor_batch

    def equals(self, other: object) -> bool:
        """Same rows, same columns (in any order) holding equal values, equal meta_info.

        Examples:
            >>> batch = DataProto.from_dict({"x": torch.arange(3)}, {"u": [1, 2, 3]})
            >>> batch.equals(batch.clone()), batch.equals(batch[:2])
            (True, False)
            >>> batch.equals(batch.select(batch_keys=[], non_tensor_batch_keys=["u"]))
            False
        """
        if not isinstance(other, DataProto) or len(self) != len(other):
            return False
        names = self.keys()
        return (
            sorted(names) == sorted(other.keys())
            and all(values_equal(self[k], other[k]) for k in names)
            and values_equal(self.meta_info, other.meta_info)
        )

    def __repr__(self) -> str:
        items = self.batch.items() if self.batch is not None else []
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in items}
        return (
            f"DataProto(len={len(self)}, batch={shapes}, "
            f"non_tensor_batch={list(self.non_tensor_batch)}, meta_info={list(self.meta_info)})"
        )

    def _key_parts(self) -> dict[str, list[str]]:
        """The keys of each part, for KeyErrors that say where a key is."""
        batch_keys = list(self.batch.keys()) if self.batch is not None else []
        columns, meta = list(self.non_tensor_batch), list(self.meta_info)
        return {"batch": batch_keys, "non_tensor_batch": columns, "meta_info": meta}

    def _derive(
        self, batch: TensorDictBase | None, columns: dict[str, np.ndarray], meta: dict[str, Any]
    ) -> DataProto:
        """A new DataProto; keeps an empty batch so a column-less result still has its rows."""
        if batch is None and not columns and self.batch is not None:
            batch = TensorDict({}, batch_size=[len(self)])
        return type(self)(batch=batch, non_tensor_batch=columns, meta_info=meta)

    # ----------------------------------------------------------------- rows
    def __getitem__(self, item: Any) -> Any:
        """int -> one-row DataProto; slice / indices / bool mask -> DataProto; str -> column."""
        if isinstance(item, str):
            if self.batch is not None and item in self.batch:
                return self.batch.get(item)
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            new = current_name(item, self.non_tensor_batch)
            if new is not item:
                return self.non_tensor_batch[new]
            raise missing_key(item, "columns", self._key_parts())
        if isinstance(item, (Tensor, np.ndarray)) and item.ndim == 0 and item.dtype != bool:
            item = int(item.item())
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            i = int(normalize_index([int(item)], len(self))[0])
            return self.slice(i, i + 1)
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        return self.select_idxs(item)

    def __setitem__(self, key: str, value: Any) -> None:
        """Set one column (tensor -> batch, anything else -> non_tensor_batch)."""
        self.update({key: value})

    def _take(self, idx: np.ndarray) -> DataProto:
        rows = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
        batch = None if self.batch is None else self.batch[rows]
        columns = {k: v[idx] for k, v in self.non_tensor_batch.items()}
        return self._derive(batch, columns, dict(self.meta_info))

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows at ``idxs`` (ints, negatives allowed, or a bool mask of length ``len(self)``).

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.tensor([10, 20, 30])})
            >>> batch.select_idxs([2, -3])["x"], batch.select_idxs(batch["x"] > 15)["x"]
            (tensor([30, 10]), tensor([20, 30]))
        """
        return self._take(normalize_index(idxs, len(self)))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None):
        """Rows ``start:end:step``; with a positive step they are views sharing storage.

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.arange(6)})
            >>> batch.slice(1, 5, 2)["x"], batch.slice(None, None, -2)["x"]
            (tensor([1, 3]), tensor([5, 3, 1]))
            >>> batch.slice(0, 2)["x"][0] = 9  # a view: writes reach ``batch``
            >>> batch["x"]
            tensor([9, 1, 2, 3, 4, 5])
        """
        check_slice(start, end, step)
        if step is not None and step <= 0:
            if step == 0:
                raise ValueError(f"slice step must not be 0, got slice({start}, {end}, {step})")
            return self._take(np.arange(len(self))[start:end:step])
        s = slice(start, end, step)
        batch = None if self.batch is None else self.batch[s]
        columns = {k: v[s] for k, v in self.non_tensor_batch.items()}
        return self._derive(batch, columns, dict(self.meta_info))

    def reorder(self, indices: Any) -> None:
        """Permute the rows in place (as verl); ``indices`` must be a permutation of the rows.

        Examples:
            >>> batch = DataProto.from_dict(
            ...     tensors={"x": torch.tensor([10, 20, 30])}, non_tensors={"uid": ["a", "b", "c"]}
            ... )
            >>> batch.reorder([2, 0, 1])
            >>> batch["x"], batch["uid"]
            (tensor([30, 10, 20]), array(['c', 'a', 'b'], dtype=object))
        """
        taken = self._take(check_permutation(normalize_index(indices, len(self)), len(self)))
        self.batch, self.non_tensor_batch = taken.batch, taken.non_tensor_batch

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` when interleaved, else ``abab``.

        Examples:
            >>> batch = DataProto.from_dict({"x": torch.tensor([1, 2])}, {"u": ["a", "b"]})
            >>> batch.repeat(2)["x"], batch.repeat(2, interleave=False)["u"]
            (tensor([1, 1, 2, 2]), array(['a', 'b', 'a', 'b'], dtype=object))
        """
        times = check_count(repeat_times, "repeat_times")
        rows = np.arange(len(self))
        return self._take(np.repeat(rows, times) if interleave else np.tile(rows, times))

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times (0 drops it), in row order.

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.tensor([1, 2, 3])})
            >>> batch.sample_level_repeat([2, 0, 1])["x"]
            tensor([1, 1, 3])
        """
        counts = repeat_counts(repeat_times, len(self))
        return self._take(np.repeat(np.arange(len(self)), counts))

    # ----------------------------------------------------------------- columns
    def select(
        self,
        batch_keys: KeysArg = None,
        non_tensor_batch_keys: KeysArg = None,
        meta_info_keys: KeysArg = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Only the named columns and meta_info keys (None = all of that kind); tensors are
        shared with ``self`` unless ``deepcopy``.

        Examples:
            >>> batch = DataProto.from_dict(
            ...     tensors={"x": torch.zeros(2), "y": torch.ones(2)},
            ...     non_tensors={"uid": ["a", "b"]},
            ...     meta_info={"step": 1},
            ... )
            >>> part = batch.select(batch_keys=["y"], non_tensor_batch_keys=[])
            >>> part.keys(), part.meta_info, part["y"].data_ptr() == batch["y"].data_ptr()
            (['y'], {'step': 1}, True)
        """
        bkeys = keys_arg(batch_keys, "batch_keys")
        nkeys = keys_arg(non_tensor_batch_keys, "non_tensor_batch_keys")
        mkeys = keys_arg(meta_info_keys, "meta_info_keys")
        wanted = (bkeys or [], nkeys or [], mkeys or [])
        check_keys(self.batch, self.non_tensor_batch, self.meta_info, wanted)
        batch = self.batch
        if batch is not None:
            batch = batch.select(*bkeys) if bkeys is not None else batch.copy()
        columns = self.non_tensor_batch
        columns = {k: columns[k] for k in nkeys} if nkeys is not None else dict(columns)
        meta = self.meta_info
        meta = {k: meta[k] for k in mkeys} if mkeys is not None else dict(meta)
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            columns, meta = copy.deepcopy(columns), copy.deepcopy(meta)
        return self._derive(batch, columns, meta)

    def pop(
        self,
        batch_keys: KeysArg = None,
        non_tensor_batch_keys: KeysArg = None,
        meta_info_keys: KeysArg = None,
    ) -> DataProto:
        """Remove the named columns / meta_info keys and return them (None = none, as verl).

        Examples:
            >>> batch = DataProto.from_dict(
            ...     tensors={"x": torch.zeros(2), "y": torch.ones(2)},
            ...     non_tensors={"uid": ["a", "b"]},
            ... )
            >>> popped = batch.pop(batch_keys=["y"], non_tensor_batch_keys=["uid"])
            >>> popped.keys(), batch.keys(), popped["y"]
            (['y', 'uid'], ['x'], tensor([1., 1.]))
        """
        bkeys = keys_arg(batch_keys, "batch_keys") or []
        nkeys = keys_arg(non_tensor_batch_keys, "non_tensor_batch_keys") or []
        mkeys = keys_arg(meta_info_keys, "meta_info_keys") or []
        check_keys(self.batch, self.non_tensor_batch, self.meta_info, (bkeys, nkeys, mkeys))
        n = len(self)
        popped = TensorDict({k: self.batch.pop(k) for k in bkeys}, batch_size=[n])  # type: ignore[union-attr]
        columns = {k: self.non_tensor_batch.pop(k) for k in nkeys}
        meta = {k: self.meta_info.pop(k) for k in mkeys}
        if self.batch is None and not self.non_tensor_batch and n:
            self.batch = TensorDict({}, batch_size=[n])  # keep the row count
        return type(self)(batch=popped, non_tensor_batch=columns, meta_info=meta)

    def rename(self, old_keys: KeysArg = None, new_keys: KeysArg = None) -> DataProto:
        """Rename columns in place (in batch or non_tensor_batch, wherever each lives).

        Examples:
            >>> batch = DataProto.from_dict({"x": torch.zeros(2)}, {"u": [1, 2]})
            >>> batch.rename(["x", "u"], ["scores", "uid"]).keys()
            ['scores', 'uid']
        """
        old = keys_arg(old_keys, "old_keys") or []
        new = keys_arg(new_keys, "new_keys") or []
        check_rename(old, new, self.keys())
        for o, nk in zip(old, new, strict=True):
            if o in self.non_tensor_batch:
                self.non_tensor_batch[nk] = self.non_tensor_batch.pop(o)
            elif o != nk and self.batch is not None:
                self.batch.rename_key_(o, nk)
        return self

    def _check_rows(self, other_len: int, op: str) -> None:
        if self.keys() and other_len != len(self):
            raise ValueError(
                f"{op} needs equal row counts: this DataProto has {len(self)} rows, the other "
                f"{other_len}"
            )

    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s columns and meta_info in place; shared keys must hold equal values.

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.zeros(2)}, meta_info={"step": 1})
            >>> more = DataProto.from_dict(non_tensors={"uid": ["a", "b"]}, meta_info={"lr": 0.1})
            >>> batch.union(more).keys(), batch.meta_info
            (['x', 'uid'], {'step': 1, 'lr': 0.1})
        """
        if not isinstance(other, DataProto):
            raise ValueError(
                f"union needs a DataProto, got {short_repr(other)} ({type(other).__name__})"
            )
        self._check_rows(len(other), "union")
        other_keys = other.keys()
        check_union({k: self[k] for k in self.keys()}, {k: other[k] for k in other_keys}, "column")
        check_union(self.meta_info, other.meta_info, "meta_info key")
        self.update({k: other[k] for k in other_keys if k not in self})
        for key, value in other.meta_info.items():
            self.meta_info.setdefault(key, value)
        return self

    def update(self, other: DataProto | Mapping[str, Any]) -> DataProto:
        """Set columns in place, overwriting (tensor -> batch, else non-tensor); a DataProto
        also overwrites meta_info keys. Returns self.

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.zeros(2)})
            >>> batch.update({"x": torch.ones(2), "uid": ["a", "b"]}).keys(), batch["x"]
            (['x', 'uid'], tensor([1., 1.]))
        """
        if isinstance(other, DataProto):
            self._check_rows(len(other), "update")
            self.update({k: other[k] for k in list(other.keys())})
            self.meta_info.update(other.meta_info)
            return self
        other = mapping_arg(other, "update: the argument", "a DataProto or a dict", False)
        values, n = coerce_columns(other, len(self) if self.keys() else None)
        self.batch = assign_columns(self.batch, self.non_tensor_batch, values, n or 0)
        self.check_consistency()
        return self

    # ----------------------------------------------------------------- many at once
    @classmethod
    def concat(cls, data: Sequence[DataProto]) -> DataProto:
        """Rows of all parts in order; keys must match; ``meta_info['metrics']`` is merged
        into lists, any other meta_info key must agree.

        Examples:
            >>> a = DataProto.from_dict({"x": torch.arange(2)}, meta_info={"metrics": {"m": 1}})
            >>> b = DataProto.from_dict({"x": torch.arange(1)}, meta_info={"metrics": {"m": 2}})
            >>> both = DataProto.concat([a, b])
            >>> both["x"], both.meta_info
            (tensor([0, 1, 0]), {'metrics': {'m': [1, 2]}})
        """
        parts = concat_parts(data, DataProto)
        batch, columns = concat_columns([(p.batch, p.non_tensor_batch, len(p)) for p in parts])
        return cls(batch, columns, merge_meta_info([p.meta_info for p in parts]))

    def chunk(self, chunks: int) -> list[DataProto]:
        """``chunks`` consecutive pieces sized as ``numpy.array_split`` does (views of self).

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.arange(5)})
            >>> [part["x"].tolist() for part in batch.chunk(2)]
            [[0, 1, 2], [3, 4]]
        """
        bounds = np.cumsum([0, *chunk_sizes(len(self), chunks)]).tolist()
        return [self.slice(a, b) for a, b in itertools.pairwise(bounds)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive pieces of ``split_size`` rows (the last may be shorter).

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.arange(5)})
            >>> [part["x"].tolist() for part in batch.split(2)]
            [[0, 1], [2, 3], [4]]
        """
        size = check_count(split_size, "split_size")
        return [self.slice(i, i + size) for i in range(0, len(self), size)] or [self.slice(0, 0)]

    def group_by(self, keys: str | Sequence[str]) -> dict[Any, DataProto]:
        """Rows grouped by the value of one column (a tuple for several), first-seen order.

        Examples:
            >>> batch = DataProto.from_dict(
            ...     tensors={"x": torch.arange(4)}, non_tensors={"uid": ["b", "a", "b", "a"]}
            ... )
            >>> {uid: rows["x"].tolist() for uid, rows in batch.group_by("uid").items()}
            {'b': [0, 2], 'a': [1, 3]}
        """
        names = keys_arg(keys, "group_by keys") or []
        if not names:
            raise ValueError(f"group_by needs at least one key, got {keys!r}")
        for key in names:
            if key not in self:
                raise missing_key(key, "columns", self._key_parts(), "group_by key")
        groups = group_indices({k: self[k] for k in names}, len(self))
        return {g: self._take(np.asarray(rows, dtype=np.int64)) for g, rows in groups.items()}

    def iter_minibatches(
        self,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int = 1,
        drop_last: bool = False,
    ) -> Iterator[DataProto]:
        """Minibatches over ``epochs`` passes; the shuffle of epoch ``e`` is seeded with
        ``derive_seed(seed, e)``, so the order depends on ``seed`` only.

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.arange(5)})
            >>> [mb["x"].tolist() for mb in batch.iter_minibatches(2, shuffle=False)]
            [[0, 1], [2, 3], [4]]
            >>> [len(mb) for mb in batch.iter_minibatches(2, seed=7, epochs=2, drop_last=True)]
            [2, 2, 2, 2]
            >>> a, b = (list(batch.iter_minibatches(2, seed=7)) for _ in range(2))
            >>> all(x.equals(y) for x, y in zip(a, b))  # the same seed, the same order
            True
        """
        orders = minibatch_orders(len(self), batch_size, shuffle, seed, epochs, drop_last)
        return (self._take(order) for order in orders)

    # ----------------------------------------------------------------- copies, devices, disk
    def to(self, device: torch.device | str) -> DataProto:
        """Move the tensors to ``device`` in place (as verl); returns self.

        Examples:
            >>> batch = DataProto.from_dict(tensors={"x": torch.zeros(2)})
            >>> batch.to("cpu") is batch, batch["x"].device
            (True, device(type='cpu'))
        """
        if self.batch is not None:
            self.batch = self.batch.to(device_arg(device))
        return self

    def clone(self) -> DataProto:
        """A deep copy sharing no storage or objects with ``self``.

        Examples:
            >>> batch = DataProto.from_dict({"x": torch.zeros(2)}, {"u": [[1], [2]]})
            >>> copy = batch.clone()
            >>> copy["x"][0] = 7.0
            >>> copy["u"][0].append(3)
            >>> batch["x"], batch["u"][0], copy["u"][0]
            (tensor([0., 0.]), [1], [1, 3])
        """
        batch = self.batch.clone() if self.batch is not None else None
        return type(self)(
            batch, copy.deepcopy(self.non_tensor_batch), copy.deepcopy(self.meta_info)
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the tensors as one consolidated buffer (one storage, copied once); the
        default unpickling restores the three attributes from it."""
        return pickled_state(self.batch, self.non_tensor_batch, self.meta_info)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write to ``path`` (``torch.save`` of the consolidated DataProto).

        Examples:
            >>> import os, tempfile
            >>> batch = DataProto.from_dict({"x": torch.arange(3)}, {"u": [1, 2, 3]})
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     batch.save(os.path.join(tmp, "batch.pt"))
            ...     DataProto.load(os.path.join(tmp, "batch.pt")).equals(batch)
            True
        """
        save_checked(self, path)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], map_location: torch.device | str | None = None
    ) -> DataProto:
        """Read a DataProto written by ``save``.

        Examples:
            >>> import os, tempfile
            >>> batch = DataProto.from_dict(
            ...     {"x": torch.arange(3)}, {"u": ["a", "b", "c"]}, meta_info={"step": 2}
            ... )
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     batch.save(os.path.join(tmp, "batch.pt"))
            ...     loaded = DataProto.load(os.path.join(tmp, "batch.pt"), map_location="cpu")
            >>> loaded["x"], loaded["u"], loaded.meta_info
            (tensor([0, 1, 2]), array(['a', 'b', 'c'], dtype=object), {'step': 2})
        """
        return load_checked(path, map_location, DataProto)

    # ----------------------------------------------------------------- ROLL and verl layouts
    def to_roll(self, **options: Any) -> DataProto:
        """These rows in ROLL's agentic layout (``rollpipe.data.roll_layout.to_roll``).

        Examples:
            >>> from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
            >>> from rollpipe.data.rows import trajectory_rows
            >>> turn = Turn(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.5, -0.5],
            ...             versions=[0, 0], reward=1.0, finish_reason="stop",
            ...             action_valid=True, action_text="", observation="o")
            >>> traj = Trajectory(EpisodeSpec(group_id=0, episode_id=0, seed=0), env_id=0,
            ...                   turns=[turn], score=1.0, success=True, end_reason="terminated")
            >>> roll = trajectory_rows([traj], pad_token_id=0).to_roll()
            >>> roll["infer_logprobs"], roll["traj_id"]  # logprobs shifted by one, as ROLL
            (tensor([[ 0.0000, -0.5000, -0.5000]]), array(['frozenlake_0_0'], dtype=object))
        """
        from rollpipe.data.roll_layout import to_roll

        return to_roll(self, **options)

    def to_verl(self, **options: Any) -> Any:
        """These rows as verl's agent loop batch (``rollpipe.data.verl_layout.to_verl``).

        Needs verl; ``rollpipe.data.verl_layout.verl_parts`` gives the same fields without it.

        Examples:
            >>> from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
            >>> from rollpipe.data.rows import trajectory_rows
            >>> from rollpipe.data.verl_layout import verl_parts
            >>> turn = Turn(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.5, -0.5],
            ...             versions=[0, 0], reward=1.0, finish_reason="stop",
            ...             action_valid=True, action_text="", observation="o")
            >>> traj = Trajectory(EpisodeSpec(group_id=0, episode_id=0, seed=0), env_id=0,
            ...                   turns=[turn], score=1.0, success=True, end_reason="terminated")
            >>> rows = trajectory_rows([traj], pad_token_id=0)
            >>> tensors, columns, meta = verl_parts(rows)  # what to_verl() holds
            >>> tensors["prompts"], tensors["responses"], tensors["rm_scores"]
            (tensor([[1, 2]]), tensor([[3, 4]]), tensor([[0., 1.]]))
            >>> rows.to_verl().batch["responses"]  # needs verl  # doctest: +SKIP
            tensor([[3, 4]])
        """
        from rollpipe.data.verl_layout import to_verl

        return to_verl(self, **options)
