"""Pad a ``DataProto`` to a multiple of a world size and drop the padding again (as verl).

``pad_dataproto_to_divisor`` and ``unpad_dataproto`` are verl's and ROLL's names for them.
"""

from __future__ import annotations

import numpy as np

from rollpipe.data.proto._indexing import check_count
from rollpipe.data.proto.dataproto import DataProto

__all__ = ["pad_dataproto_to_divisor", "pad_to_divisor", "unpad", "unpad_dataproto"]


def pad_to_divisor(dp: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``dp`` to a multiple of ``size_divisor`` rows by repeating rows from the start
    (as verl); returns ``(padded, pad_size)``.

    Examples:
        >>> import torch
        >>> batch = DataProto.from_dict({"x": torch.arange(5)}, meta_info={"step": 1})
        >>> padded, pad_size = pad_to_divisor(batch, 4)
        >>> padded["x"], pad_size, padded.meta_info
        (tensor([0, 1, 2, 3, 4, 0, 1, 2]), 3, {'step': 1})
    """
    k = check_count(size_divisor, "size_divisor")
    n = len(dp)
    pad_size = (-n) % k
    if pad_size == 0:
        return dp, 0
    padded = type(dp).concat([dp, dp.select_idxs(np.arange(pad_size) % n)])
    padded.meta_info = dict(dp.meta_info)  # not merged: metrics would be counted twice
    return padded, pad_size


def unpad(dp: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows that ``pad_to_divisor`` added.

    Examples:
        >>> import torch
        >>> padded, pad_size = pad_to_divisor(DataProto.from_dict({"x": torch.arange(3)}), 2)
        >>> padded["x"], unpad(padded, pad_size)["x"]
        (tensor([0, 1, 2, 0]), tensor([0, 1, 2]))
    """
    pad = check_count(pad_size, "pad_size", minimum=0)
    if pad > len(dp):
        raise ValueError(f"pad_size={pad} is larger than the DataProto's {len(dp)} rows")
    return dp.slice(0, len(dp) - pad) if pad else dp


pad_dataproto_to_divisor = pad_to_divisor  # the verl / ROLL names
unpad_dataproto = unpad
