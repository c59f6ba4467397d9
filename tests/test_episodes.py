"""EpisodeSource: group seeding, mixing, replacements, checkpointing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.nodes import Loader

from rollpipe.nodes.episode_source import EnvChoice, EpisodeSource
from rollpipe.nodes.signals import PipelineSignals


@settings(max_examples=50, deadline=None)
@given(
    num_groups=st.integers(0, 8),
    group_size=st.integers(1, 5),
    redundancy=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_groups_share_a_seed_and_ids_are_unique(num_groups, group_size, redundancy, seed):
    specs = list(EpisodeSource(num_groups, group_size, seed, redundancy=redundancy))
    members = group_size + redundancy
    assert len(specs) == num_groups * members
    assert len({s.episode_id for s in specs}) == len(specs)
    for g in range(num_groups):
        group = [s for s in specs if s.group_id == g]
        assert len(group) == members
        assert len({s.seed for s in group}) == 1
    assert len({s.seed for s in specs}) == num_groups  # distinct groups, distinct seeds
    assert specs == list(EpisodeSource(num_groups, group_size, seed, redundancy=redundancy))


def test_mix_follows_weights_and_is_fixed_per_group():
    envs = [EnvChoice("frozenlake", weight=3.0), EnvChoice("sokoban", weight=1.0, tag="box")]
    specs = list(EpisodeSource(400, 2, seed=7, envs=envs))
    by_group = {}
    for s in specs:
        by_group.setdefault(s.group_id, set()).add((s.env_name, s.tag))
    assert all(len(v) == 1 for v in by_group.values())
    share = sum(v == {("frozenlake", "frozenlake")} for v in by_group.values()) / 400
    assert 0.65 < share < 0.85
    assert {("sokoban", "box")} in by_group.values()


def test_endless_source_keeps_going():
    source = EpisodeSource(None, 2, seed=0)
    specs = [next(source) for _ in range(1000)]
    assert specs[-1].group_id == 499


def test_replacements_extend_a_finite_source():
    signals = PipelineSignals()
    source = EpisodeSource(1, 2, seed=0, signals=signals)
    assert [s.group_id for s in source] == [0, 0]
    signals.request_groups(2)
    assert [next(source).group_id for _ in range(4)] == [1, 1, 2, 2]
    with pytest.raises(StopIteration):
        next(source)


def test_checkpoint_resumes_mid_group():
    loader = Loader(EpisodeSource(4, 3, seed=5))
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    state = loader.state_dict()
    tail = list(it)
    resumed = Loader(EpisodeSource(4, 3, seed=5))
    resumed.load_state_dict(state)
    assert list(resumed) == tail
    assert head + tail == list(EpisodeSource(4, 3, seed=5))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        EpisodeSource(1, 0)
    with pytest.raises(ValueError, match=r"num_groups \(or None: endless\) must be an int >= 0"):
        EpisodeSource(-1, 2)
    with pytest.raises(ValueError, match="weights must not all be 0"):
        EpisodeSource(1, 2, envs=[EnvChoice("frozenlake", weight=0.0)])
    with pytest.raises(
        ValueError, match=r"EnvChoice.weight must be a finite number in \[0.0, inf\), got -1.0"
    ):
        EnvChoice("frozenlake", weight=-1.0)
