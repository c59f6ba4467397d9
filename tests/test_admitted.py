"""Admitted: the EpisodeRunner's book keeps the lowest unsettled group id exactly, whatever the
order episodes are admitted, finish and leave in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.agent.records import EpisodeSpec
from rollpipe.nodes.admitted import Admitted


def spec(group: int) -> EpisodeSpec:
    return EpisodeSpec(group_id=group, episode_id=0, seed=group)


@settings(max_examples=200, deadline=None)
@given(
    in_order=st.booleans(),
    steps=st.lists(
        st.tuples(st.sampled_from(["admit", "finish", "pop"]), st.integers(0, 6)), max_size=60
    ),
    queued=st.lists(st.integers(0, 9), max_size=3),
    pulled=st.none() | st.integers(0, 9),
)
def test_lowest_group_is_the_minimum_of_what_may_still_yield(
    in_order, steps, queued, pulled
) -> None:
    book = Admitted(in_order)
    unfinished: list[int] = []
    for action, value in steps:
        if action == "admit":
            unfinished.append(book.admit(spec(value)))
        elif action == "finish" and unfinished:
            book.finish(unfinished.pop(value % len(unfinished)), None)
        elif action == "pop":
            book.pop()
        also = [spec(g) for g in queued]
        expected = [s.group_id for s in book.pending.values()] + queued
        expected += [] if pulled is None else [pulled]
        assert book.lowest_group(also, pulled) == (min(expected) if expected else None)
