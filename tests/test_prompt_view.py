"""PromptView: a growing context handed to an engine without a copy, fixed as it was."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpipe.engines import SamplingParams, ScriptedEngine
from rollpipe.engines.inputs import CheckedIds, PromptView, check_prompt, check_prompt_view

PARTS = st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), min_size=1, max_size=6)


@given(parts=PARTS, vocab=st.integers(1, 45))
def test_a_view_stays_the_ids_it_was_taken_at(parts, vocab) -> None:
    """Appends after a view never show in it; it reads, compares, checks and pickles as
    the list of its ids then."""
    ids = CheckedIds()
    taken: list[tuple[PromptView, list[int]]] = []
    for part in parts:
        ids.extend_checked(part, trusted=True)
        taken.append((ids.view(), list(ids)))
    for view, then in taken:
        assert view == then and list(view) == then and len(view) == len(then)
        assert [view[i] for i in range(-len(then), len(then))] == then + then
        assert view[1:] == then[1:] and view[::-1] == then[::-1]
        with pytest.raises(IndexError):
            view[len(then)]
        assert (view.low, view.high) == (min(then), max(then))
        copy = pickle.loads(pickle.dumps(view))
        assert type(copy) is CheckedIds and copy == then and copy.high == max(then)
        try:
            expected: list[int] | str = check_prompt(then, vocab)
        except ValueError as e:
            expected = str(e)
        for check in (check_prompt, check_prompt_view):
            try:
                got = check(view, vocab)
            except ValueError as e:
                got = str(e)  # type: ignore[assignment]
            assert got == expected
            if check is check_prompt_view and not isinstance(got, str):
                assert got is view  # no copy
            elif not isinstance(got, str):
                assert type(got) is CheckedIds and got is not ids  # a copy of its own


def test_an_empty_view_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        check_prompt_view(CheckedIds().view())


def test_a_scripted_policy_gets_the_view_itself() -> None:
    """ScriptedEngine declares takes_views: the policy reads the episode's context with
    no copy made anywhere on the way."""
    seen: list[object] = []

    def policy(prompt: object, params: SamplingParams) -> list[int]:
        seen.append(prompt)
        return [1]

    ids = CheckedIds([3, 4, 5])
    view = ids.view()
    with ScriptedEngine(policy) as engine:
        [gen] = engine.generate_batch([view], SamplingParams(max_tokens=2))
    assert gen.token_ids == (1,) and seen == [view] and seen[0] is view
