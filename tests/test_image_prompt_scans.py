"""The image-pad checks on a prompt that grows in place read only what it added since
they last ran (``CheckedIds.scans``), and say exactly what a check of the whole prompt
says, for any growth: a long image conversation costs each turn what the turn added."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.engines.images import (
    ImageTokenError,
    VisionTokens,
    check_image_prompt,
    check_reported_prompt,
    expand_image_pads,
)
from rollpipe.engines.inputs import CheckedIds

PAD, VIDEO = 9, 8
TOKENS = VisionTokens(image_pad=PAD, video_pad=VIDEO)
pieces = st.lists(st.lists(st.sampled_from([1, 2, 3, PAD, PAD, VIDEO]), max_size=6), max_size=6)


def outcome(check, *args):
    try:
        check(*args)
    except ImageTokenError as e:
        return str(e)
    return None


@settings(max_examples=300, deadline=None)
@given(parts=pieces)
def test_a_growing_prompt_is_checked_as_a_whole_one(parts: list[list[int]]) -> None:
    ids = CheckedIds()
    for part in parts:
        ids.extend_checked(part)
        whole = list(ids)
        for images in {whole.count(PAD), whole.count(PAD) + 1}:
            assert outcome(check_image_prompt, ids.view(), images, TOKENS) == outcome(
                check_image_prompt, whole, images, TOKENS
            )


@settings(max_examples=300, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.lists(st.sampled_from([1, 2, 3]), max_size=4), st.integers(0, 2)),
        min_size=1,
        max_size=6,
    ),
    sizes=st.lists(st.integers(1, 5), min_size=12, max_size=12),
    corrupt=st.integers(0, 40),
)
def test_a_reported_prompt_is_checked_turn_by_turn_as_a_whole_one(
    turns: list[tuple[list[int], int]], sizes: list[int], corrupt: int
) -> None:
    """Each turn adds text and some images; the engine reports the expansion (correct,
    or with one id changed): the check on the growing prompt agrees with a fresh one."""
    ids, grids = CheckedIds(), []
    for text, images in turns:
        ids.extend_checked([*text, *[x for _ in range(images) for x in (PAD, 1)]])
        grids += [[1, 2, 2 * sizes[len(grids)]] for _ in range(images)]
        reported = expand_image_pads(list(ids), grids, 2, PAD)
        if 0 <= corrupt < len(reported):
            reported[corrupt] = 7 if reported[corrupt] != 7 else 1
        fresh = outcome(check_reported_prompt, list(ids), tuple(reported), TOKENS)
        assert outcome(check_reported_prompt, ids.view(), tuple(reported), TOKENS) == fresh
        corrupt -= len(reported)  # one corruption at most, in some turn


def test_a_corrupted_prefix_is_caught_after_a_good_turn() -> None:
    ids = CheckedIds([1, PAD, 2])
    check_reported_prompt(ids.view(), (1, PAD, PAD, 2), TOKENS)
    ids.extend_checked([3, PAD, 4])
    with pytest.raises(ImageTokenError, match="not the sent prompt"):
        check_reported_prompt(ids.view(), (1, 7, PAD, 2, 3, PAD, 4), TOKENS)
