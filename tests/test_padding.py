"""Padding kernels: pad/unpad identity for any lengths and side, masks, position ids, errors."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.data.padding import (
    PaddedTokens,
    pad_1d,
    pad_tokens,
    padded_length,
    position_ids_from_mask,
    unpad_rows,
)

SETTINGS = settings(max_examples=50, deadline=None)

token_rows = st.lists(st.lists(st.integers(0, 1000), max_size=12), min_size=1, max_size=8)
sides = st.sampled_from(["right", "left"])
multiples = st.one_of(st.none(), st.integers(1, 8))


@SETTINGS
@given(rows=token_rows, side=sides, multiple_of=multiples)
def test_pad_then_unpad_is_identity(rows, side, multiple_of):
    padded = pad_tokens(rows, pad_token_id=-1, side=side, multiple_of=multiple_of)
    back = unpad_rows(padded.input_ids, padded.attention_mask)
    assert [r.tolist() for r in back] == rows


@SETTINGS
@given(rows=token_rows, side=sides, multiple_of=multiples)
def test_padded_layout_matches_a_reference(rows, side, multiple_of):
    p = pad_tokens(rows, pad_token_id=7, side=side, multiple_of=multiple_of)
    width = max(len(r) for r in rows)
    if multiple_of:
        width = -(-width // multiple_of) * multiple_of
    assert p.input_ids.shape == (len(rows), width)
    assert p.input_ids.dtype == p.attention_mask.dtype == p.position_ids.dtype == torch.int64
    for i, row in enumerate(rows):
        pad = [7] * (width - len(row))
        mask = (
            [0] * len(pad) + [1] * len(row) if side == "left" else [1] * len(row) + [0] * len(pad)
        )
        ids = pad + row if side == "left" else row + pad
        assert p.input_ids[i].tolist() == ids
        assert p.attention_mask[i].tolist() == mask
        # verl: cumsum(mask) - 1 clipped at 0
        pos, seen = [], 0
        for m in mask:
            seen += m
            pos.append(max(seen - 1, 0))
        assert p.position_ids[i].tolist() == pos
    assert p.lengths.tolist() == [len(r) for r in rows]


@SETTINGS
@given(
    rows=st.lists(
        st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), max_size=9),
        min_size=1,
        max_size=6,
    ),
    side=sides,
    extra=st.integers(0, 4),
)
def test_pad_1d_float_rows_with_forced_length(rows, side, extra):
    tensors = [torch.tensor(r, dtype=torch.float32) for r in rows]
    length = max(len(r) for r in rows) + extra
    out = pad_1d(tensors, pad_value=-5.0, side=side, length=length)
    assert out.shape == (len(rows), length)
    assert out.dtype == torch.float32
    lengths = torch.tensor([len(r) for r in rows])
    cols = torch.arange(length)
    mask = cols < lengths[:, None] if side == "right" else cols >= (length - lengths)[:, None]
    assert bool((out[~mask] == -5.0).all())
    assert [r.tolist() for r in unpad_rows(out, mask)] == [t.tolist() for t in tensors]


def test_left_padding_gives_zero_positions_on_pads():
    p = pad_tokens([[5, 6, 7], [8]], pad_token_id=0, side="left")
    assert p.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert p.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_pad_tokens_accepts_lists_and_tensors_alike():
    from_lists = pad_tokens([[1, 2], [3]], 0)
    from_tensors = pad_tokens([torch.tensor([1, 2], dtype=torch.int32), torch.tensor([3])], 0)
    for field in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(getattr(from_lists, field), getattr(from_tensors, field))
    assert isinstance(from_lists, PaddedTokens)


def test_empty_rows_pad_to_zero_width_or_multiple():
    assert pad_tokens([[], []], 0).input_ids.shape == (2, 0)
    assert pad_tokens([[], [1]], 0, multiple_of=4).input_ids.tolist() == [[0] * 4, [1, 0, 0, 0]]


def test_position_ids_from_mask_batched_shape():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 1, 1], [0, 1, 2, 3]]


def test_padded_length_rounds_up():
    assert padded_length([3, 5, 1]) == 5
    assert padded_length([3, 5, 1], multiple_of=4) == 8
    assert padded_length(torch.tensor([8]), multiple_of=4) == 8
    assert padded_length([], multiple_of=4) == 0


def test_unpad_returns_independent_rows_per_row():
    padded = pad_1d([torch.tensor([1, 2, 3]), torch.tensor([4])], side="left")
    mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    rows = unpad_rows(padded, mask)
    assert [r.tolist() for r in rows] == [[1, 2, 3], [4]]


# ---------------------------------------------------------------- errors


def test_error_no_rows():
    with pytest.raises(ValueError, match="at least one row"):
        pad_1d([])


def test_error_row_not_1d():
    with pytest.raises(ValueError, match=r"row 1 must be a 1-D tensor, got \(2, 2\)"):
        pad_1d([torch.zeros(3), torch.zeros(2, 2)])


def test_error_mixed_dtypes():
    with pytest.raises(
        ValueError, match=re.escape("row 1 has dtype torch.int64 but row 0 has torch.float32")
    ):
        pad_1d([torch.zeros(3), torch.zeros(2, dtype=torch.long)])


def test_error_length_shorter_than_longest_row():
    with pytest.raises(ValueError, match=r"length=2 is shorter than the padded longest row \(3\)"):
        pad_1d([torch.zeros(3)], length=2)


def test_error_bad_side():
    with pytest.raises(ValueError, match="side must be 'right' or 'left', got 'middle'"):
        pad_tokens([[1]], 0, side="middle")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_error_bad_multiple_of(bad):
    with pytest.raises(ValueError, match="multiple_of must be an int >= 1"):
        padded_length([3], multiple_of=bad)


def test_error_unpad_shape_mismatch():
    with pytest.raises(ValueError, match=r"same \[B, L\] shape, got \(2, 3\) and \(2, 4\)"):
        unpad_rows(torch.zeros(2, 3), torch.ones(2, 4))
