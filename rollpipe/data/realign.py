"""Moving native rows between padding layouts, for the ROLL and verl layouts.

Native rows (``rollpipe.data.rows``) are padded once, to the batch's own width, on the
right by default. ROLL wants every row right-aligned to a width it chooses; verl wants
each row split into a left-padded prompt and a right-padded response. Each move is one
``gather`` per field over the whole batch, driven by the row's masks: no per-row Python.

Nothing here imports ``DataProto`` (so ``DataProto.to_roll`` / ``to_verl`` can delegate
to the layout modules without an import cycle): a batch is anything shaped like one,
the ``NativeBatch`` protocol.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from tensordict import TensorDictBase
from torch import Tensor

__all__ = [
    "NativeBatch",
    "Place",
    "columns_of",
    "pad_id_of",
    "per_token",
    "require",
    "right_aligned",
    "split_prompt_response",
]

_B = TypeVar("_B", bound="NativeBatch")


class NativeBatch(Protocol):
    """What the layouts read from a rollpipe ``DataProto`` (and how they build one)."""

    @property
    def batch(self) -> TensorDictBase | None: ...

    @property
    def non_tensor_batch(self) -> dict[str, np.ndarray]: ...

    @property
    def meta_info(self) -> dict[str, Any]: ...

    @classmethod
    def from_dict(
        cls: type[_B],
        tensors: Mapping[str, Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> _B: ...


def columns_of(batch: NativeBatch) -> tuple[dict[str, Tensor], dict[str, np.ndarray]]:
    """The batch's tensors and object columns as two plain dicts (shared, not copied)."""
    td = batch.batch
    tensors: dict[str, Tensor] = {}
    if td is not None:  # (iterating a TensorDict gives its rows, hence .keys())
        tensors = {k: td.get(k) for k in td.keys()}  # noqa: SIM118
    return tensors, dict(batch.non_tensor_batch)


def require(present: Iterable[str], names: Iterable[str], what: str) -> None:
    """Raise KeyError naming every column of ``names`` that ``present`` lacks."""
    have = set(present)
    missing = [n for n in names if n not in have]
    if missing:
        raise KeyError(
            f"{what} needs the native row columns {missing}, which this batch lacks; it "
            f"has {sorted(have)}. Convert a batch as rollpipe's Collate builds it "
            "(rollpipe.data.rows.trajectory_rows / step_rows)"
        )


def pad_id_of(input_ids: Tensor, attention_mask: Tensor, given: int | None) -> int | None:
    """``given``, else the id found at the batch's padded positions, else None."""
    if given is not None:
        return int(given)
    pads = input_ids[attention_mask == 0]
    return int(pads[0]) if pads.numel() else None


def per_token(value: Any, rows: int, width: int) -> bool:
    """Whether ``value`` is a per-token tensor of a ``[rows, width]`` batch."""
    return (
        isinstance(value, Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, width)
    )


class Place:
    """Where each output position of ``[B, width]`` takes its value from in the native rows.

    ``index[b, k]`` is the native column, ``valid[b, k]`` whether position ``k`` holds a
    real token (elsewhere the output is the fill value). ``take`` applies it to a field.
    """

    def __init__(self, index: Tensor, valid: Tensor) -> None:
        self.index = index
        self.valid = valid

    def take(self, field: Tensor, fill: float | int | bool) -> Tensor:
        """``field`` ([B, W, ...]) moved to this placement, ``fill`` off the tokens."""
        rows, width = self.index.shape
        if field.shape[1] == 0:  # nothing to take from: every position is a pad
            return torch.full((rows, width, *field.shape[2:]), fill, dtype=field.dtype)
        index = self.index.clamp(0, field.shape[1] - 1)
        index = index.view(rows, width, *([1] * (field.dim() - 2))).expand(
            rows, width, *field.shape[2:]
        )
        out = field.gather(1, index)
        valid = self.valid.view(rows, width, *([1] * (field.dim() - 2)))
        return torch.where(valid, out, torch.full_like(out, fill))


def _aligned_order(attention_mask: Tensor) -> Tensor:
    """Per row, the native columns of its real tokens in order, then those of its pads."""
    return torch.sort((attention_mask == 0).to(torch.int8), dim=1, stable=True).indices


def right_aligned(attention_mask: Tensor, width: int) -> Place:
    """Every row's real tokens first, in order, then pads, over ``width`` columns.

    ``width`` must hold the longest row (ValueError otherwise); the native layout may be
    left- or right-padded.
    """
    rows, native = attention_mask.shape
    lengths = attention_mask.sum(1)
    longest = int(lengths.max()) if rows else 0
    if width < longest:
        raise ValueError(f"width={width} is shorter than the longest row ({longest} tokens)")
    order = _aligned_order(attention_mask)
    columns = torch.arange(width).expand(rows, width)
    index = order.gather(1, columns.clamp(max=max(native - 1, 0))) if native else columns
    return Place(index, columns < lengths[:, None])


def split_prompt_response(
    attention_mask: Tensor,
    prompt_mask: Tensor,
    prompt_width: int | None = None,
    response_width: int | None = None,
) -> tuple[Place, Place]:
    """Each row as a left-padded prompt and a right-padded response (verl's layout).

    The prompt is the row's first ``prompt_mask.sum()`` real tokens, the response the rest.
    Widths default to the longest prompt / response; a smaller one is a ValueError.
    """
    rows, native = attention_mask.shape
    order = _aligned_order(attention_mask)
    lengths = attention_mask.sum(1)
    prompts = (prompt_mask.bool() & attention_mask.bool()).sum(1)
    responses = lengths - prompts
    p_width = _width(prompts, prompt_width, "prompt_length")
    r_width = _width(responses, response_width, "response_length")
    last = max(native - 1, 0)
    # prompt position k holds aligned token k - (p_width - p) when that is >= 0
    p_cols = torch.arange(p_width).expand(rows, p_width) - (p_width - prompts)[:, None]
    p_valid = p_cols >= 0
    prompt = Place(order.gather(1, p_cols.clamp(0, last)) if native else p_cols, p_valid)
    # response position k holds aligned token p + k while k < the response's length
    r_range = torch.arange(r_width).expand(rows, r_width)
    r_cols = r_range + prompts[:, None]
    response = Place(
        order.gather(1, r_cols.clamp(0, last)) if native else r_cols,
        r_range < responses[:, None],
    )
    return prompt, response


def _width(lengths: Tensor, given: int | None, name: str) -> int:
    longest = int(lengths.max()) if lengths.numel() else 0
    if given is None:
        return longest
    if given < longest:
        raise ValueError(f"{name}={given} is shorter than the longest one in the batch ({longest})")
    return int(given)
