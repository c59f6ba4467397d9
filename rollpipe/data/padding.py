"""Padding kernels: ragged 1-D rows to a padded ``[B, L]`` batch and back.

One output allocation per field and no per-token Python work: the rows are concatenated
once and written through the bool mask of the valid positions (row-major order of the
mask matches the order of the concatenated rows, for either padding side): on the CPU by
numpy's boolean assignment, about three times as fast as ``masked_scatter_``, which
other devices use. ``flat_layout`` computes that mask once per batch so callers that already
hold flat tensors (``rollpipe.data.rows``) pad many fields without splitting them.
Position ids follow verl: ``cumsum(mask) - 1`` clipped at 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import numpy as np
import torch
from torch import Tensor

from rollpipe._utils.checks import check_int

__all__ = [
    "FlatLayout",
    "PaddedTokens",
    "flat_layout",
    "pad_1d",
    "pad_tokens",
    "padded_length",
    "padded_tokens",
    "position_ids_from_mask",
    "unpad_rows",
]

Side = Literal["right", "left"]

# dtypes whose CPU fills go through numpy (same values as torch.full, for these dtypes)
_NUMPY_FILLS = frozenset((torch.bool, torch.int32, torch.int64, torch.float32, torch.float64))


def _check_side(side: str) -> None:
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")


def padded_length(lengths: Sequence[int] | Tensor, multiple_of: int | None = None) -> int:
    """The padded width ``L``: the longest length, rounded up to ``multiple_of`` if given.

    An empty ``lengths`` gives 0.
    """
    if multiple_of is not None:
        check_int("multiple_of", multiple_of, 1)
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


@attrs.frozen
class FlatLayout:
    """Where the elements of ragged rows, concatenated row after row, go in a ``[B, width]``
    batch.

    Built once per batch (see ``flat_layout``) and shared by every field of it, so a field
    costs one fill and one masked write of its flat tensor: no split into rows, no
    per-row checks, no re-concatenation. ``mask`` is the bool mask of valid positions; its
    row-major order matches the flat order for either padding side.
    """

    lengths: Tensor
    width: int
    side: Side
    mask: Tensor
    total: int

    @property
    def starts(self) -> Tensor:
        """``[B]`` column of each row's first element (0 for right padding)."""
        if self.side == "right":
            return torch.zeros_like(self.lengths)
        return self.width - self.lengths

    def pad(
        self, flat: Tensor, pad_value: float | int = 0, *, where: Tensor | None = None
    ) -> Tensor:
        """``flat`` written into a fresh ``[B, width]`` tensor of its dtype, in flat order.

        By default ``flat`` holds every row's elements (``total`` of them). With ``where``
        (a bool ``[B, width]`` mask inside ``mask``, e.g. the response tokens) ``flat``
        holds only the elements at ``where``, in row-major order; the rest is ``pad_value``.
        """
        target = self.mask if where is None else where
        expected = self.total if where is None else int(torch.count_nonzero(target))
        if flat.dim() != 1 or flat.shape[0] != expected:
            raise ValueError(
                f"flat must be 1-D with {expected} elements (one per "
                f"{'row element' if where is None else 'True in where'}), got shape "
                f"{tuple(flat.shape)}; build it by concatenating the rows in order"
            )
        if flat.device.type == "cpu" and flat.dtype in _NUMPY_FILLS and not flat.requires_grad:
            values = flat.numpy()
            filled = np.full(tuple(target.shape), pad_value, dtype=values.dtype)
            filled[target.cpu().numpy()] = values
            return torch.from_numpy(filled)
        out = torch.full(tuple(target.shape), pad_value, dtype=flat.dtype, device=flat.device)
        return out.masked_scatter_(target.to(flat.device), flat)

    def attention_mask(self) -> Tensor:
        """Int64 ``[B, width]``: 1 on valid positions."""
        if self.mask.device.type == "cpu":  # see position_ids
            return torch.from_numpy(self.mask.numpy().astype(np.int64))
        return self.mask.to(torch.long)

    def position_ids(self) -> Tensor:
        """Int64 ``[B, width]`` equal to ``position_ids_from_mask(self.attention_mask())``,
        computed from the lengths (no cumsum over the batch).

        On the CPU numpy allocates it: numpy asks for huge pages for large arrays, and a
        fresh batch-sized tensor faults its pages in several times faster that way."""
        if self.lengths.device.type == "cpu":
            at = np.arange(self.width, dtype=np.int64)[None, :]
            if self.side == "right":
                last = np.maximum(self.lengths.numpy() - 1, 0)[:, None]
                return torch.from_numpy(np.minimum(at, last))
            out = at - self.starts.numpy()[:, None]
            return torch.from_numpy(np.maximum(out, 0, out=out))
        cols = torch.arange(self.width, device=self.lengths.device).unsqueeze(0)
        if self.side == "right":
            return torch.minimum(cols, (self.lengths - 1).clamp(min=0).unsqueeze(1))
        return (cols - self.starts.unsqueeze(1)).clamp(min=0)

    def prefix_mask(self, counts: Tensor) -> Tensor:
        """Bool ``[B, width]``: the first ``counts[b]`` elements of each row ``b``."""
        cols = torch.arange(self.width, device=self.lengths.device).unsqueeze(0)
        if self.side == "right":
            return cols < counts.unsqueeze(1)
        starts = self.starts.unsqueeze(1)
        return (cols >= starts) & (cols < starts + counts.unsqueeze(1))

    def locate(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` in the padded batch of flat element indices ``positions``.

        Negative indices count from the end, as in Python; they must be in range.
        """
        if self.total == 0:
            raise ValueError("locate needs at least one element; every row here is empty")
        flat_ends = torch.cumsum(self.lengths, 0)
        positions = positions % self.total
        rows = torch.searchsorted(flat_ends, positions, right=True)
        cols = positions - (flat_ends - self.lengths)[rows] + self.starts[rows]
        return rows, cols


def flat_layout(
    lengths: Sequence[int] | Tensor,
    *,
    side: Side = "right",
    multiple_of: int | None = None,
    length: int | None = None,
    device: torch.device | str | None = None,
) -> FlatLayout:
    """The layout of rows of ``lengths`` padded on ``side``.

    The width is the longest row rounded up to ``multiple_of``, or exactly ``length`` if
    given (it must fit the longest row), as in ``pad_1d``.
    """
    _check_side(side)
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
    width = padded_length(lengths, multiple_of)
    if length is not None:
        if length < width:
            raise ValueError(
                f"length={length} is shorter than the padded longest row ({width}); "
                f"pass length >= {width} or leave it None"
            )
        width = length
    return FlatLayout(
        lengths=lengths,
        width=width,
        side=side,
        mask=_valid_mask(lengths, width, side),
        total=int(lengths.sum()),
    )


def _rows_layout(
    rows: Sequence[Tensor], side: Side, multiple_of: int | None, length: int | None
) -> FlatLayout:
    """Check ``rows`` (1-D, one dtype) and lay them out."""
    _check_side(side)  # before the row checks, as callers expect
    if len(rows) == 0:
        raise ValueError(
            "padding needs at least one row, got an empty sequence; skip empty batches"
        )
    dtype = rows[0].dtype
    for i, row in enumerate(rows):
        if not isinstance(row, Tensor) or row.dim() != 1:
            shape = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
            raise ValueError(f"row {i} must be a 1-D tensor, got {shape}; flatten it first")
        if row.dtype != dtype:
            raise ValueError(
                f"row {i} has dtype {row.dtype} but row 0 has {dtype}; cast rows to one dtype"
            )
    lengths = [row.shape[0] for row in rows]
    return flat_layout(
        lengths, side=side, multiple_of=multiple_of, length=length, device=rows[0].device
    )


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
    layout = _rows_layout(rows, side, multiple_of, length)
    return layout.pad(torch.cat(list(rows)).to(rows[0].device), pad_value)


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
    layout = _rows_layout(tensors, side, multiple_of, length)
    return padded_tokens(layout, torch.cat(tensors).to(tensors[0].device), pad_token_id)


def padded_tokens(layout: FlatLayout, flat_ids: Tensor, pad_token_id: int) -> PaddedTokens:
    """Pad already-flat token ids (every row's ids, row after row) by ``layout``."""
    return PaddedTokens(
        input_ids=layout.pad(flat_ids.to(torch.long), pad_token_id),
        attention_mask=layout.attention_mask(),
        position_ids=layout.position_ids(),
    )


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids as in verl: ``cumsum(mask) - 1`` clipped at 0 (int64)."""
    return torch.clip(torch.cumsum(attention_mask.to(torch.long), dim=-1) - 1, min=0)


def unpad_rows(padded: Tensor, attention_mask: Tensor) -> list[Tensor]:
    """The rows of a padded ``[B, L]`` batch: the exact inverse of ``pad_1d`` / ``pad_tokens``."""
    if padded.dim() != 2 or padded.shape != attention_mask.shape:
        raise ValueError(
            f"padded and attention_mask must be the same [B, L] shape, got "
            f"{tuple(padded.shape)} and {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(device=padded.device, dtype=torch.bool)
    lengths = mask.sum(dim=-1).tolist()
    return list(torch.split(padded[mask], lengths))
