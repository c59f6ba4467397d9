"""Env step metrics: the built-in envs report ROLL's ``info["metrics"]`` keys, and a
trajectory's steps aggregate the way ROLL's env managers aggregate them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpipe.envs import FrozenLake, GridTextEnv, Sokoban, make
from rollpipe.envs.base import GRID_METRICS_AGG_MODE
from rollpipe.envs.metrics import AGG_MODES, aggregate_metrics, step_metrics

# ROLL's FrozenLakeEnv.step / SokobanEnv.step report these, aggregated this way.
ROLL_KEYS = {"action_is_effective", "action_is_valid", "success", "format_penalty"}
ROLL_AGG_MODE = {
    "action_is_effective": "mean",
    "action_is_valid": "mean",
    "success": "last",
    "format_penalty": "mean",
}
ENVS = [("frozenlake", {}), ("frozenlake", {"slippery": True}), ("sokoban", {})]

texts = st.one_of(
    st.sampled_from(["Left", "Down", "Right", "Up"]).map(lambda a: f"<answer>{a}</answer>"),
    st.sampled_from(["<answer>jump</answer>", "no answer", ""]),
)


@pytest.mark.parametrize(("name", "config"), ENVS, ids=["lake", "slippery-lake", "sokoban"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), plan=st.lists(texts, min_size=1, max_size=15))
def test_every_step_reports_rolls_metrics(
    name: str, config: dict[str, Any], seed: int, plan: list[str]
) -> None:
    env = make(name, **config, format_penalty=-0.25)
    assert isinstance(env, GridTextEnv)
    env.reset(seed)
    steps, modes = [], {}
    for text in plan:
        if env.done:
            break
        before = env.render()
        _, _, _, _, info = env.step(text)
        values, step_modes = step_metrics(info)  # well formed, by rollpipe's own check
        assert set(values) == ROLL_KEYS and step_modes == ROLL_AGG_MODE
        assert values["action_is_valid"] == float(info["action_valid"])
        assert values["success"] == float(info["success"])
        assert values["action_is_effective"] == float(env.render() != before)
        assert values["format_penalty"] == (0.0 if info["action_valid"] else -0.25)
        if not info["action_valid"]:
            assert values["action_is_effective"] == 0.0  # an invalid answer changes nothing
        steps.append(values)
        modes.update(step_modes)
    episode = aggregate_metrics(steps, modes)
    assert episode["success"] == float(env.success)  # "last"
    assert episode["action_is_valid"] == pytest.approx(
        np.mean([s["action_is_valid"] for s in steps])
    )


def test_bumping_into_an_edge_or_wall_is_valid_but_not_effective() -> None:
    lake = FrozenLake(level="P_\n_G")
    lake.reset(0)
    bump = lake.step("<answer>Up</answer>")[4]["metrics"]
    assert bump["action_is_valid"] and not bump["action_is_effective"]
    move = lake.step("<answer>Right</answer>")[4]["metrics"]
    assert move["action_is_effective"] and not move["success"]
    goal = lake.step("<answer>Down</answer>")[4]["metrics"]
    assert goal["success"] and goal["action_is_effective"]
    room = Sokoban(level="#####\n#P_O#\n#_X_#\n#####")
    room.reset(0)
    wall = room.step("<answer>Left</answer>")[4]["metrics"]
    assert wall["action_is_valid"] and not wall["action_is_effective"]
    assert wall["format_penalty"] == 0.0  # the step penalty is a reward, not a format penalty


def test_agg_mode_table_is_rolls_and_is_not_shared_between_steps() -> None:
    assert GRID_METRICS_AGG_MODE == ROLL_AGG_MODE
    env = FrozenLake(level="P_\n_G")
    env.reset(0)
    info = env.step("<answer>Up</answer>")[4]
    info["metrics_agg_mode"]["success"] = "mean"  # a caller editing its copy
    assert env.step("<answer>Up</answer>")[4]["metrics_agg_mode"] == ROLL_AGG_MODE


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=8))
def test_each_mode_reduces_as_named(values: list[float]) -> None:
    steps = [{"x": v} for v in values]
    expected = {
        "mean": np.mean(values),
        "sum": np.sum(values),
        "min": min(values),
        "max": max(values),
        "first": values[0],
        "last": values[-1],
    }
    assert set(expected) == set(AGG_MODES)
    for mode, want in expected.items():
        assert aggregate_metrics(steps, {"x": mode})["x"] == pytest.approx(want, abs=1e-6)
    assert aggregate_metrics(steps)["x"] == pytest.approx(np.mean(values), abs=1e-6)  # default


def test_a_metric_counts_only_the_steps_that_reported_it() -> None:
    got = aggregate_metrics([{"a": 1.0}, {"a": 3.0, "b": 10.0}, {}], {"b": "sum"})
    assert got == {"a": 2.0, "b": 10.0}
    assert aggregate_metrics([]) == {}


def test_step_metrics_converts_numbers_and_tolerates_their_absence() -> None:
    values, modes = step_metrics(
        {"metrics": {"ok": np.bool_(True), "n": np.int64(2), "f": True}, "other": object()}
    )
    assert values == {"ok": 1.0, "n": 2.0, "f": 1.0}
    assert all(type(v) is float for v in values.values()) and modes == {}
    assert step_metrics({}) == ({}, {})
    assert step_metrics({"metrics": None, "metrics_agg_mode": None}) == ({}, {})


@pytest.mark.parametrize(
    ("info", "message"),
    [
        ({"metrics": [1.0]}, r"info\['metrics'\] must be a dict of numbers, got list"),
        ({"metrics": {"x": "1.0"}}, r"info\['metrics'\]\['x'\] must be a number .* got str"),
        ({"metrics": {"x": None}}, r"info\['metrics'\]\['x'\] must be a number"),
        ({"metrics_agg_mode": "last"}, r"info\['metrics_agg_mode'\] must be a dict"),
        ({"metrics_agg_mode": {"x": "median"}}, r"\['x'\] is 'median'; use one of"),
    ],
)
def test_malformed_step_metrics_are_named(info: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        step_metrics(info)
