"""Trajectory records: validation, derived properties, hashing and pickling."""

from __future__ import annotations

import pickle
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpipe.agent.records import EpisodeSpec, Group, Trajectory, Turn


def turn(n: int = 3, *, versions: list[int] | None = None, reward: float = 0.0) -> Turn:
    return Turn(
        prompt_ids=[1, 2, 3],
        response_ids=list(range(10, 10 + n)),
        logprobs=[-0.25] * n,
        versions=versions if versions is not None else [0] * n,
        reward=reward,
        finish_reason="stop",
        action_valid=True,
        action_text="<answer>Left</answer>",
        observation="grid",
    )


def traj(turns: tuple[Turn, ...] = (), **kw: object) -> Trajectory:
    fields: dict[str, object] = {
        "spec": EpisodeSpec(group_id=3, episode_id=7, seed=11, tag="lake"),
        "env_id": 2,
        "turns": turns,
        "score": sum(t.reward for t in turns),
        "success": False,
        "end_reason": "max_turns",
    }
    fields.update(kw)
    return Trajectory(**fields)  # type: ignore[arg-type]


def test_episode_spec_normalises_env_config_and_is_hashable() -> None:
    a = EpisodeSpec(1, 2, 3, env_config={"size": 4, "p_frozen": 0.8})  # type: ignore[arg-type]
    b = EpisodeSpec(1, 2, 3, env_config=(("p_frozen", 0.8), ("size", 4)))
    assert a == b and hash(a) == hash(b)
    assert a.env_config == (("p_frozen", 0.8), ("size", 4))
    assert a.env_kwargs == {"size": 4, "p_frozen": 0.8}
    assert pickle.loads(pickle.dumps(a)) == a


@pytest.mark.parametrize("field", ["group_id", "episode_id", "seed"])
def test_episode_spec_rejects_negative_ids_naming_the_field(field: str) -> None:
    kw: dict[str, Any] = {"group_id": 0, "episode_id": 0, "seed": 0, field: -1}
    with pytest.raises(ValueError, match=f"EpisodeSpec.{field}"):
        EpisodeSpec(**kw)


def test_turn_needs_one_logprob_and_version_per_token() -> None:
    with pytest.raises(ValueError, match=r"Turn\.logprobs has 2 entries but response_ids has 3"):
        Turn([1], [4, 5, 6], [0.0, 0.0], [0, 0, 0], 0.0, "stop", True, "a", "o")
    with pytest.raises(ValueError, match=r"Turn\.versions"):
        Turn([1], [4, 5, 6], [0.0] * 3, [0], 0.0, "stop", True, "a", "o")


def test_turn_rejects_abort_finish_reason() -> None:
    # an aborted generation is regenerated, never recorded
    with pytest.raises(ValueError, match="finish_reason"):
        Turn([1], [4], [0.0], [0], 0.0, "abort", True, "a", "o")


def test_turn_converts_to_tuples_and_flags_length_cut() -> None:
    t = Turn([1, 2], [4], [-1], [5], 1, "length", 0, "a", "o")
    assert t.prompt_ids == (1, 2) and t.logprobs == (-1.0,) and isinstance(t.reward, float)
    assert t.length_cut and t.action_valid is False and t.stepped is True


def test_trajectory_error_iff_end_reason_error() -> None:
    with pytest.raises(ValueError, match=r"Trajectory\.error"):
        traj(end_reason="error")
    with pytest.raises(ValueError, match=r"Trajectory\.error"):
        traj(error="boom")
    assert traj(end_reason="error", error="RuntimeError('x')").error == "RuntimeError('x')"
    with pytest.raises(ValueError, match="end_reason"):
        traj(end_reason="done")


def test_trajectory_properties() -> None:
    t = traj((turn(2, versions=[3, 4], reward=0.5), turn(3, versions=[4, 6, 5], reward=1.0)))
    assert (t.group_id, t.episode_id, t.seed, t.tag) == (3, 7, 11, "lake")
    assert t.num_turns == 2 and t.num_generated_tokens == 5
    assert (t.min_version, t.max_version) == (3, 6)
    assert t.step_scores == [0.5, 1.0]
    assert t.group_uid == "lake/g3" and t.traj_id == "lake/g3/e7"
    assert t.initial_observation == "grid"
    assert pickle.loads(pickle.dumps(t)) == t and hash(t) == hash(pickle.loads(pickle.dumps(t)))


def test_zero_turn_trajectory_properties() -> None:
    t = traj(end_reason="max_length", final_observation="start")
    assert t.num_generated_tokens == 0 and t.min_version == -1 and t.max_version == -1
    assert t.initial_observation == "start"
    # tag falls back to the env name
    assert traj(spec=EpisodeSpec(0, 1, 2)).traj_id == "frozenlake/g0/e1"


@given(st.lists(st.lists(st.integers(0, 50), max_size=6), min_size=1, max_size=5))
def test_version_range_covers_every_generated_token(versions: list[list[int]]) -> None:
    t = traj(tuple(turn(len(v), versions=v) for v in versions))
    flat = [x for v in versions for x in v]
    assert t.num_generated_tokens == len(flat)
    assert (t.min_version, t.max_version) == ((min(flat), max(flat)) if flat else (-1, -1))


def test_env_metrics_are_floats_that_take_part_in_equality_not_hashing() -> None:
    t = traj(env_metrics={"success": True, "action_is_valid": np.float32(0.5), "n": 3})
    assert t.env_metrics == {"success": 1.0, "action_is_valid": 0.5, "n": 3.0}
    assert all(type(v) is float for v in t.env_metrics.values())
    plain = traj()
    assert plain.env_metrics == {} and plain != t and hash(plain) == hash(t)
    assert pickle.loads(pickle.dumps(t)) == t
    old_state = {k: v for k, v in t.to_state().items() if k != "env_metrics"}  # an older checkpoint
    assert Trajectory.from_state(old_state).env_metrics == {}


def test_group_checks_membership_and_keeps_drops() -> None:
    a, b = traj((turn(reward=1.0),)), traj((turn(reward=0.0),), spec=EpisodeSpec(3, 8, 11))
    g = Group(3, [a, b], drops={"stale": 2}, tag_drops={"lake": {"stale": 2}})
    assert len(g) == 2 and g.scores == [1.0, 0.0] and g.drops == {"stale": 2}
    assert g.tag_drops == {"lake": {"stale": 2}}
    assert g == Group(3, (a, b))  # drop counts take no part in equality
    assert hash(g) == hash(Group(3, (a, b)))  # nor in hashing
    assert g.min_version == 0
    with pytest.raises(ValueError, match="Group 4 holds trajectories of other groups"):
        Group(4, [a])


@given(
    prompt=st.lists(st.integers(0, 2**40), min_size=1, max_size=30),
    response=st.lists(st.integers(0, 2**40), max_size=30),
)
def test_turn_packs_its_ids_and_logprobs_for_collation(prompt: list[int], response: list[int]):
    """The packed arrays hold exactly the turn's ids and logprobs, are read-only, follow
    ``attrs.evolve`` and pickling, and take no part in equality."""
    n = len(response)
    t = Turn(
        prompt_ids=prompt,
        response_ids=response,
        logprobs=[-0.5 - i for i in range(n)],
        versions=[0] * n,
        reward=0.0,
        finish_reason="length",
        action_valid=False,
        action_text="",
        observation="o",
    )
    assert t.token_array.dtype == np.int64 and t.token_array.tolist() == prompt + response
    assert t.logprob_array.dtype == np.float32
    assert t.logprob_array.tolist() == [np.float32(x) for x in t.logprobs]
    assert not t.token_array.flags.writeable and not t.logprob_array.flags.writeable
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back.token_array.tolist() == t.token_array.tolist()
    shorter = attrs.evolve(t, prompt_ids=prompt[:1])
    assert shorter.token_array.tolist() == prompt[:1] + response
