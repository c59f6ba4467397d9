"""DataProto <-> one ``TensorDict`` as verl lays it out: tensors as they are, non-tensor
columns as ``NonTensorStack``, meta_info entries as ``NonTensorData``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from rollpipe.data.proto.columns import object_array

__all__ = ["join_tensordict", "split_tensordict"]


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


def join_tensordict(
    batch: TensorDictBase | None, columns: Mapping[str, np.ndarray], meta: Mapping[str, Any], n: int
) -> TensorDictBase:
    """The inverse of ``split_tensordict``: one TensorDict of ``n`` rows."""
    td = batch.copy() if batch is not None else TensorDict({}, batch_size=[n])
    for key, col in columns.items():
        td.set(key, NonTensorStack.from_list(list(col)))
    for key, value in meta.items():
        if key in td:
            raise ValueError(f"meta_info key {key!r} is also a column; rename one of them")
        td.set_non_tensor(key, value)
    return td
