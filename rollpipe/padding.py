"""Padding kernels: ragged 1-D rows to a padded ``[B, L]`` batch and back.

One output allocation per call and no per-token Python work: the rows are concatenated
once and written through a boolean mask of the valid positions (row-major order of a
mask matches the order of the concatenated rows, for either padding side).
Position ids follow verl: ``cumsum(mask) - 1`` clipped at 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import torch
from torch import Tensor

__all__ = [
    "PaddedTokens",
    "pad_1d",
    "pad_tokens",
    "padded_length",
    "position_ids_from_mask",
    "unpad",
]

Side = Literal["right", "left"]


def _check_side(side: str) -> None:
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")


def padded_length(lengths: Sequence[int] | Tensor, multiple_of: int | None = None) -> int:
    """The padded width ``L``: the longest length, rounded up to ``multiple_of`` if given.

    An empty ``lengths`` gives 0.
    """
    if multiple_of is not None and (
        isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1
    ):
        raise ValueError(f"multiple_of must be a positive int or None, got {multiple_of!r}")
    if isinstance(lengths, Tensor):
        longest = int(lengths.max().item()) if lengths.numel() else 0
    else:
        longest = max((int(n) for n in lengths), default=0)
    if longest < 0:
        raise ValueError(f"lengths must be non-negative, got a longest length of {longest}")
    if multiple_of is not None:
        longest = -(-longest // multiple_of) * multiple_of
    return longest


def _valid_mask(lengths: Tensor, width: int, side: str) -> Tensor:
    """Bool ``[B, width]`` mask of the positions that hold tokens."""
    cols = torch.arange(width, device=lengths.device)
    if side == "right":
        return cols.unsqueeze(0) < lengths.unsqueeze(1)
    return cols.unsqueeze(0) >= (width - lengths).unsqueeze(1)


def _pad_with_mask(
    rows: Sequence[Tensor],
    pad_value: float | int,
    side: str,
    multiple_of: int | None,
    length: int | None,
) -> tuple[Tensor, Tensor]:
    """Pad ``rows`` and also return the bool mask of valid positions."""
    _check_side(side)
    if len(rows) == 0:
        raise ValueError(
            "padding needs at least one row, got an empty sequence; skip empty batches"
        )
    dtype, device = rows[0].dtype, rows[0].device
    for i, row in enumerate(rows):
        if not isinstance(row, Tensor) or row.dim() != 1:
            shape = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
            raise ValueError(f"row {i} must be a 1-D tensor, got {shape}; flatten it first")
        if row.dtype != dtype:
            raise ValueError(
                f"row {i} has dtype {row.dtype} but row 0 has {dtype}; cast rows to one dtype"
            )
    lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.long, device=device)
    width = padded_length(lengths, multiple_of)
    if length is not None:
        if length < width:
            raise ValueError(
                f"length={length} is shorter than the padded longest row ({width}); "
                f"pass length >= {width} or leave it None"
            )
        width = length
    mask = _valid_mask(lengths, width, side)
    out = torch.full((len(rows), width), pad_value, dtype=dtype, device=device)
    out[mask] = torch.cat(list(rows)).to(device)
    return out, mask


def pad_1d(
    rows: Sequence[Tensor],
    pad_value: float | int = 0,
    *,
    side: Side = "right",
    multiple_of: int | None = None,
    length: int | None = None,
) -> Tensor:
    """Pad 1-D ``rows`` into one ``[B, L]`` tensor of their dtype.

    ``L`` is the longest row rounded up to ``multiple_of``, or exactly ``length`` if given
    (it must fit the longest row). ``side="left"`` puts the padding before the tokens.
    """
    return _pad_with_mask(rows, pad_value, side, multiple_of, length)[0]


@attrs.frozen
class PaddedTokens:
    """A padded token batch: ids, 0/1 attention mask and position ids, all ``[B, L]`` int64."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor

    @property
    def lengths(self) -> Tensor:
        """Number of real tokens per row, ``[B]``."""
        return self.attention_mask.sum(dim=-1)


def pad_tokens(
    rows: Sequence[Tensor | list[int]],
    pad_token_id: int,
    *,
    side: Side = "right",
    multiple_of: int | None = None,
    length: int | None = None,
) -> PaddedTokens:
    """Pad token rows (lists of ints or 1-D tensors) and build mask and position ids."""
    tensors = [
        r.to(torch.long) if isinstance(r, Tensor) else torch.as_tensor(r, dtype=torch.long)
        for r in rows
    ]
    ids, mask = _pad_with_mask(tensors, pad_token_id, side, multiple_of, length)
    attention_mask = mask.to(torch.long)
    return PaddedTokens(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    )


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids as in verl: ``cumsum(mask) - 1`` clipped at 0 (int64)."""
    return torch.clip(torch.cumsum(attention_mask.to(torch.long), dim=-1) - 1, min=0)


def unpad(padded: Tensor, attention_mask: Tensor) -> list[Tensor]:
    """The rows of a padded ``[B, L]`` batch: the exact inverse of ``pad_1d`` / ``pad_tokens``."""
    if padded.dim() != 2 or padded.shape != attention_mask.shape:
        raise ValueError(
            f"padded and attention_mask must be the same [B, L] shape, got "
            f"{tuple(padded.shape)} and {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(device=padded.device, dtype=torch.bool)
    lengths = mask.sum(dim=-1).tolist()
    return list(torch.split(padded[mask], lengths))
