"""Batch metrics: the global keys, the per-tag ``env/{tag}/...`` keys, and how they agree
(hypothesis: per-tag counts and rates, weighted by counts, give the global ones)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.nodes import IterableWrapper

from rollpipe.agent.records import EpisodeSpec, Group, Trajectory, Turn
from rollpipe.data.metrics import DROP_KINDS, TAG_KEYS, batch_metrics, tag_metrics
from rollpipe.envs import FrozenLake, register
from rollpipe.nodes.batch import Batch
from rollpipe.nodes.collate import Collate, merge_tag_drops
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

TAGS = ["lake", "sokoban", "a/b"]

# every key batch_metrics gave before per-tag metrics: none may disappear
GLOBAL_KEYS = {
    "trajectories",
    "episode_score/mean",
    "episode_score/min",
    "episode_score/max",
    "success_rate",
    "turns/mean",
    "turns/min",
    "turns/max",
    "response_length/mean",
    "response_length/min",
    "response_length/max",
    "generated_tokens",
    "time/wall_s",
    "time/env_s",
    "time/engine_wait_s",
    "time/stream_s",
    "throughput/tokens_per_s",
    "end_reason/error",
    *(f"dropped/{kind}" for kind in DROP_KINDS),
}


def make_turn(valid: bool | None, stepped: bool = True, reward: float = 0.0) -> Turn:
    return Turn(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        logprobs=[-0.1] * 3,
        versions=[0] * 3,
        reward=reward,
        finish_reason="stop" if stepped else "length",
        action_valid=valid,
        action_text="<answer>Up</answer>",
        observation="o",
        stepped=stepped,
    )


@st.composite
def trajectories(draw: st.DrawFn, episode_id: int) -> Trajectory:
    turns = draw(
        st.lists(
            st.builds(
                make_turn,
                st.sampled_from([True, False, None]),  # None: the env did not report it
                st.booleans(),
                st.sampled_from([0.0, 1.0]),
            )
        )
    )
    metrics = draw(
        st.dictionaries(
            st.sampled_from(["success", "action_is_valid", "x"]),
            st.sampled_from([0.0, 0.25, 1.0]),
        )
    )
    return Trajectory(
        spec=EpisodeSpec(0, episode_id, 0, tag=draw(st.sampled_from(TAGS))),
        env_id=0,
        turns=turns,
        score=draw(st.sampled_from([-1.0, 0.0, 0.5, 2.0])),
        success=draw(st.booleans()),
        end_reason="terminated",
        env_metrics=metrics,
    )


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[Trajectory], dict[str, dict[str, int]]]:
    n = draw(st.integers(0, 12))
    trajs = [draw(trajectories(i)) for i in range(n)]
    counts = st.dictionaries(st.sampled_from(DROP_KINDS), st.integers(0, 5), max_size=4)
    tag_drops = draw(st.dictionaries(st.sampled_from([*TAGS, "only-dropped"]), counts, max_size=3))
    return trajs, tag_drops


def summed(tag_drops: dict[str, dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for counts in tag_drops.values():
        total.update(counts)
    return dict(total)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_per_tag_metrics_add_up_to_the_global_ones(
    batch: tuple[list[Trajectory], dict[str, dict[str, int]]],
) -> None:
    trajs, tag_drops = batch
    m = batch_metrics(trajs, summed(tag_drops), tag_drops=tag_drops)
    assert set(m) >= GLOBAL_KEYS and all(type(v) is float for v in m.values())
    tags = sorted({t.tag for t in trajs} | set(tag_drops))
    env_keys = [k for k in m if k.startswith("env/")]
    assert all(any(k.startswith(f"env/{tag}/") for tag in tags) for k in env_keys)

    def per_tag(key: str) -> list[float]:
        return [m[f"env/{tag}/{key}"] for tag in tags]

    n = per_tag("trajectories")
    assert sum(n) == m["trajectories"] == len(trajs)
    total = max(len(trajs), 1)
    weighted = np.dot(n, per_tag("success_rate")) / total
    assert weighted == pytest.approx(m["success_rate"])
    assert np.dot(n, per_tag("score/mean")) / total == pytest.approx(m["episode_score/mean"])
    assert np.dot(n, per_tag("turns/mean")) / total == pytest.approx(m["turns/mean"])
    if trajs:
        assert min(per_tag("score/min")[i] for i in range(len(tags)) if n[i]) == pytest.approx(
            m["episode_score/min"]
        )
    # valid_action_rate: over the turns whose validity is known, NaN where none is
    known = [
        sum(u.action_valid is not None for t in trajs if t.tag == tag for u in t.turns)
        for tag in tags
    ]
    rates = per_tag("valid_action_rate")
    assert [math.isnan(r) for r in rates] == [k == 0 for k in known]
    if sum(known):
        rate = sum(k * r for k, r in zip(known, rates, strict=True) if k) / sum(known)
        assert rate == pytest.approx(m["valid_action_rate"])
    else:
        assert math.isnan(m["valid_action_rate"])
    for kind in DROP_KINDS:
        assert sum(per_tag(f"dropped/{kind}")) == m[f"dropped/{kind}"]
    for tag in tags:
        mine = [t for t in trajs if t.tag == tag]
        steps = [sum(u.stepped for u in t.turns) for t in mine]
        assert m[f"env/{tag}/num_actions"] == pytest.approx(np.mean(steps) if steps else 0.0)
        for name in ("success", "action_is_valid", "x"):
            reported = [t.env_metrics[name] for t in mine if name in t.env_metrics]
            key = f"env/{tag}/{name}"
            assert (key in m) == bool(reported)
            if reported:
                assert m[key] == pytest.approx(np.mean(reported))


def test_roll_names_for_a_roll_style_batch() -> None:
    """Env metrics appear under ROLL's ``env/{tag}/{name}``, next to rollpipe's keys."""
    won = Trajectory(
        spec=EpisodeSpec(0, 0, 0, env_name="sokoban", tag="SimpleSokoban"),
        env_id=0,
        turns=[make_turn(True), make_turn(False), make_turn(False, stepped=False)],
        score=1.0,
        success=True,
        end_reason="terminated",
        env_metrics={"success": 1.0, "action_is_valid": 0.5, "num_actions": 99.0},
    )
    lost = Trajectory(
        spec=EpisodeSpec(0, 1, 0, env_name="sokoban", tag="SimpleSokoban"),
        env_id=0,
        turns=[make_turn(True)],
        score=0.0,
        success=False,
        end_reason="truncated",
        env_metrics={"success": 0.0, "action_is_valid": 1.0},
    )
    m = batch_metrics([won, lost], {"filtered": 2}, tag_drops={"SimpleSokoban": {"filtered": 2}})
    tag = "env/SimpleSokoban/"
    assert m[tag + "success"] == 0.5 and m[tag + "action_is_valid"] == 0.75
    assert m[tag + "success_rate"] == 0.5 and m[tag + "trajectories"] == 2.0
    assert m[tag + "valid_action_rate"] == 0.5  # 2 of 4 turns
    assert m[tag + "num_actions"] == 1.5  # env steps: 2 and 1; rollpipe's name wins a clash
    assert m[tag + "dropped/filtered"] == 2.0 and m[tag + "dropped/stale"] == 0.0
    assert m[tag + "score/max"] == 1.0 and m[tag + "turns/mean"] == 2.0
    assert {tag + k for k in TAG_KEYS} <= set(m)


def test_valid_action_rate_counts_only_turns_whose_env_reported_it() -> None:
    """An env that does not report ``info["action_valid"]`` (every gem env) leaves its
    turns out of the rate: unknown, not invalid. With no known turn the rate is NaN."""

    def traj(episode: int, tag: str, valid: list[bool | None]) -> Trajectory:
        return Trajectory(
            spec=EpisodeSpec(0, episode, 0, tag=tag),
            env_id=0,
            turns=[make_turn(v) for v in valid],
            score=0.0,
            success=False,
            end_reason="terminated",
        )

    silent = traj(0, "gem", [None, None, None])
    m = batch_metrics([silent])
    assert math.isnan(m["valid_action_rate"]) and math.isnan(m["env/gem/valid_action_rate"])
    lake = traj(1, "lake", [True, False, True, True])
    m = batch_metrics([silent, lake, traj(2, "lake", [None, True])])
    assert m["env/lake/valid_action_rate"] == 0.8  # 4 of the 5 reported turns
    assert m["valid_action_rate"] == 0.8  # the silent env's 4 turns are left out
    assert math.isnan(m["env/gem/valid_action_rate"])
    # a cut turn that was not stepped is known invalid, whatever the env reports
    cut = Trajectory(
        spec=EpisodeSpec(0, 3, 0, tag="gem"),
        env_id=0,
        turns=[make_turn(None), make_turn(False, stepped=False)],
        score=0.0,
        success=False,
        end_reason="max_length",
    )
    assert batch_metrics([cut])["valid_action_rate"] == 0.0


def test_a_tag_with_only_drops_is_reported_with_zeros() -> None:
    m = tag_metrics("gone", [], {"stale": 3})
    assert m["env/gone/trajectories"] == 0.0 and m["env/gone/dropped/stale"] == 3.0
    assert m["env/gone/success_rate"] == 0.0 and m["env/gone/score/mean"] == 0.0
    assert math.isnan(m["env/gone/valid_action_rate"])  # no turn: unknown
    assert batch_metrics([])["trajectories"] == 0.0
    assert not any(k.startswith("env/") for k in batch_metrics([]))


def _traj(group: int, episode: int, tag: str, score: float) -> Trajectory:
    return Trajectory(
        spec=EpisodeSpec(group, episode, group, tag=tag),
        env_id=0,
        turns=[make_turn(True, reward=score)],
        score=score,
        success=score > 0,
        end_reason="terminated",
        env_metrics={"success": float(score > 0)},
    )


def test_collate_reports_the_drops_of_every_group_in_the_batch_per_tag() -> None:
    from rollpipe.nodes.groups import GroupAssembler

    scores = {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0], 3: [1.0, 0.0]}
    tags = {0: "a", 1: "b", 2: "b", 3: "a"}
    trajs = [
        _traj(g, 2 * g + m, tags[g], scores[g][m]) for g in range(4) for m in range(2)
    ]  # groups 0 and 2 have no score variance
    groups = GroupAssembler(IterableWrapper(trajs), 2, drop_group="zero_variance")
    (batch,) = list(Batch(groups, 4))
    wasted = {
        tag: sum(t.num_generated_tokens for t in trajs if t.group_id == g)
        for g, tag in ((0, "a"), (2, "b"))
    }
    assert merge_tag_drops(batch.groups) == {
        tag: {"filtered": 1, "wasted_tokens": wasted[tag]} for tag in ("a", "b")
    }
    proto = Collate(IterableWrapper([batch]), pad_token_id=0).collate(batch)
    m: dict[str, Any] = proto.meta_info["metrics"]
    assert m["dropped/filtered"] == 2.0
    assert m["dropped/wasted_tokens"] == float(sum(wasted.values()))
    assert m["env/a/dropped/filtered"] == 1.0 and m["env/b/dropped/filtered"] == 1.0
    assert m["env/a/trajectories"] == m["env/b/trajectories"] == 2.0
    assert m["env/a/success"] == m["env/b/success"] == 0.5
    one = Collate(IterableWrapper([]), pad_token_id=0).collate(batch.groups[0])
    assert one.meta_info["metrics"]["env/a/dropped/filtered"] == 1.0


def test_group_tag_drops_merge_like_drops() -> None:
    g1 = Group(0, [], drops={"stale": 1}, tag_drops={"a": {"stale": 1}})
    g2 = Group(1, [], drops={"stale": 2}, tag_drops={"a": {"stale": 1}, "b": {"stale": 1}})
    assert merge_tag_drops([g1, g2]) == {"a": {"stale": 2}, "b": {"stale": 1}}
    assert merge_tag_drops([]) == {}


class SilentLake(FrozenLake):
    """FrozenLake whose ``step`` does not report ``info["action_valid"]``, as gem's envs."""

    blocking = False

    def step(self, action_text: str) -> Any:
        obs, reward, terminated, truncated, info = super().step(action_text)
        info.pop("action_valid")
        return obs, reward, terminated, truncated, info


register("silent_lake", SilentLake, overwrite=True)


def test_an_env_that_does_not_report_action_valid_has_no_rate(
    vllm_engine: Any, tokenizer: Any
) -> None:
    """Issue 22: such an env showed ``valid_action_rate`` 0.0, as if every action were
    invalid. Its turns are unknown: the rate leaves them out (NaN for it alone)."""
    config = PipelineConfig(
        envs="silent_lake",
        group_size=2,
        batch_size=4,
        max_turns=2,
        concurrency=8,
        seed=5,
        sampling={"max_tokens": 12},
    )
    with RolloutPipeline(config, vllm_engine, tokenizer) as pipe:
        m = pipe.get_batch().meta_info["metrics"]
    assert m["turns/mean"] >= 1.0  # there were turns; their validity is unknown
    assert math.isnan(m["valid_action_rate"]) and math.isnan(m["env/silent_lake/valid_action_rate"])
    mixed = config.replace(
        envs=[{"name": "silent_lake", "tag": "silent"}, {"name": "frozenlake", "tag": "lake"}],
        batch_size=16,
    )
    with RolloutPipeline(mixed, vllm_engine, tokenizer) as pipe:
        batch = pipe.get_batch()
    m = batch.meta_info["metrics"]
    tags = set(batch.non_tensor_batch["tags"])
    assert tags == {"silent", "lake"}, tags  # both envs are in the batch (seed 5)
    assert math.isnan(m["env/silent/valid_action_rate"])
    assert 0.0 <= m["env/lake/valid_action_rate"] <= 1.0
    assert m["valid_action_rate"] == m["env/lake/valid_action_rate"]  # the known turns only
