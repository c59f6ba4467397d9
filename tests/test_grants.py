"""A metered episode source: grants carry a training step and expire as ROLL's groups do.

ROLL's GroupQueue creates ``max_traj_per_env`` groups per ``advance_step(step)`` and
expires those with ``step - create_step > async_generation_ratio``; a metered
``EpisodeSource`` does the same with grants it has not started yet.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.config import PipelineConfig
from rollpipe.nodes.episode_source import EpisodeSource
from rollpipe.nodes.signals import PipelineSignals


def metered(expire_after: int | None, group_size: int = 2) -> EpisodeSource:
    source = EpisodeSource(
        None, group_size, seed=3, signals=PipelineSignals(), metered=True, expire_after=expire_after
    )
    source.reset()
    return source


def pull_group(source: EpisodeSource) -> list[int] | None:
    """The group ids of one whole group's specs, or None if the source is dry."""
    try:
        return [source.next().group_id for _ in range(source.members_per_group)]
    except StopIteration:
        return None


def test_unstarted_grants_of_an_expired_step_are_never_started():
    source = metered(expire_after=0)
    source.signals.grant_groups(3, step=0)
    assert pull_group(source) == [0, 0]
    source.signals.grant_groups(2, step=1)  # step 0's two unstarted groups expire
    assert [pull_group(source), pull_group(source), pull_group(source)] == [[1, 1], [2, 2], None]
    assert source.expired_groups == 2


def test_a_started_group_is_finished_even_when_its_step_expires():
    source = metered(expire_after=0)
    source.signals.grant_groups(1, step=0)
    assert source.next().group_id == 0  # first member started
    source.signals.grant_groups(1, step=1)
    assert source.next().group_id == 0  # its second member still comes
    assert pull_group(source) == [1, 1] and source.expired_groups == 0


def test_replacements_are_created_at_the_current_step():
    source = metered(expire_after=0)
    source.signals.grant_groups(1, step=4)
    source.signals.request_groups(1)
    assert pull_group(source) == [0, 0] and pull_group(source) == [1, 1]
    assert pull_group(source) is None and source.expired_groups == 0


@settings(max_examples=200, deadline=None)
@given(
    ratio=st.none() | st.integers(0, 3),
    events=st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 2), st.integers(0, 5)), max_size=12
    ),
)
def test_every_granted_group_is_started_once_or_expired(ratio, events):
    """For any grants (n groups, step advance) and pulls: started + expired + still
    pending = granted; ids are consecutive; a checkpoint resumes the same stream."""
    source = metered(expire_after=ratio)
    granted, step, started = 0, 0, []
    for n, advance, pulls in events:
        step += advance
        source.signals.grant_groups(n, step=step)
        granted += n
        for _ in range(pulls):
            group = pull_group(source)
            if group is None:
                break
            started.append(group[0])
    assert started == list(range(len(started)))
    # what is left: pull it all out from a restored copy and from the original
    state = source.state_dict()
    copy = metered(expire_after=ratio)
    copy.reset(state)
    copy.signals.load_state(source.signals.get_state())
    rest = [g for g in iter(lambda: pull_group(source), None)]
    assert [g for g in iter(lambda: pull_group(copy), None)] == rest
    assert len(started) + len(rest) + source.expired_groups == granted
    if ratio is None:
        assert source.expired_groups == 0


def test_max_traj_per_env_is_checked_against_the_batch():
    assert PipelineConfig(max_traj_per_env=-1).max_traj_per_env is None  # ROLL's "auto"
    with pytest.raises(ValueError, match=r"max_traj_per_env=1 x concurrency=8.*batch_size=16"):
        PipelineConfig(max_traj_per_env=1, concurrency=8, batch_size=16)
    with pytest.raises(ValueError, match="max_traj_per_env needs async_generation_ratio"):
        PipelineConfig(max_traj_per_env=2, async_generation_ratio=None)
    with pytest.raises(ValueError, match="max_traj_per_env"):
        PipelineConfig(max_traj_per_env=0)
    assert PipelineConfig(max_traj_per_env=2, concurrency=8, group_size=4).groups_per_step == 4
