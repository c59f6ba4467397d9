"""Every PipelineConfig setting, given bad values (type confusions included: ``"no"`` for a
bool, ``1.5`` for an int, negative counts, values past the bounds that keep memory and
time finite): each fails at construction with a message naming the field. The table must
cover every flat name and pipeline-wide field, so a new setting needs its row. A setting
fails the same way given flat, inside its section, or through ``from_dict``."""

from __future__ import annotations

import math
import pickle
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe._utils.checks import MAX_TIMEOUT_S
from rollpipe.agent.episode import MAX_ABORTS, MAX_LENGTH, MAX_TURNS, MAX_WINDOW
from rollpipe.config import (
    FLAT_NAMES,
    MAX_BATCH_SIZE,
    MAX_RATIO,
    MAX_TRAJ_PER_ENV,
    WIDE,
    EpisodeSettings,
    PipelineConfig,
    SourceSettings,
)
from rollpipe.nodes.collate import MAX_PAD_MULTIPLE
from rollpipe.nodes.episode_source import MAX_GROUP_SIZE, MAX_REDUNDANCY, MAX_SEED
from rollpipe.nodes.groups import MAX_DROPS_IN_A_ROW
from rollpipe.nodes.rollout import MAX_CONCURRENCY

NAMED = (
    r"(PipelineConfig|SourceSettings|EpisodeSettings|RunnerSettings|GroupSettings|CollateSettings)"
)

# field -> bad values (each alone, on top of the defaults)
BAD: dict[str, list[Any]] = {
    "envs": [
        None,
        3,
        [],
        "nope",
        [{"name": "frozenlake", "weight": -1}],
        [{"name": "frozenlake", "config": 3}],
        [{"nme": "frozenlake"}],
        ["frozenlake", 3],
        [{"name": "frozenlake", "config": {"size": -3}}],  # the env's own check
        [{"name": "frozenlake", "config": {"sise": 4}}],
        "not_registered_here",
        "no_such_package.envs:Game",
        "rollpipe.envs.frozenlake:NoSuchClass",
        "rollpipe.envs.frozenlake:DEFAULT_ANSWER_PATTERN",  # not callable
    ],
    "group_size": [0, -1, 1.5, "4", True, None, MAX_GROUP_SIZE + 1],
    "batch_size": [0, -4, 1.5, "16", True, None, 6, MAX_BATCH_SIZE + 4],
    "num_groups": [0, -1, 1.5, "3", True],
    "redundancy": [-1, 1.5, "1", True, None, 10**30],
    "seed": [-1, 1.5, "0", True, None, 2**64],
    "max_turns": [0, 1.5, "5", True, None, 10**9],
    "max_length": [0, 1, -1, 1.5, "1024", True, None, 10**30],
    "concurrency": [0, 1.5, "32", True, None, 10**6],
    "env_workers": [-1, 1.5, "2", True, None, 10**6],
    "env_timeout_s": [0, -1, math.nan, math.inf, "60", True, 1e30],
    "generation_timeout_s": [0, -1, math.nan, math.inf, "60", True, 1e30],
    "reward_clip": [0, -1, math.nan, math.inf, "1", True],
    "env_backend": ["ray2", None, 1, True],
    "sampling": [
        None,
        3,
        "x",
        {"max_tokenz": 3},
        {"max_tokens": -1},
        {"max_tokens": 1.5},
        {"max_tokens": "48"},
        {"temperature": "hot"},
        {"temperature": -1},
        {"top_p": 2},
    ],
    "system_prompt": [123, b"x", ["a"], True],
    "history_window": [-1, 1.5, "2", True, 2],  # 2: the default level needs none
    "layout": ["x", None, 1],
    "level": ["x", None, 1, "step"],  # "step": needs a history_window
    "pad_to_multiple_of": [0, -1, 1.5, "8", True, 10**30],
    "keep_group": [3, "nope", "zero_variance", True, "os:no_such_function"],
    "drop_group": [3, "nope", "scores_differ", True],
    "async_generation_ratio": [-1, 1.5, "0", True, 10**30],
    "max_off_policy_strategy": ["Drop", "block", "", None, 1, True],
    "max_traj_per_env": [0, -2, 1.5, "1", True, 10**30],
    "max_drops_in_a_row": [0, -1, 1.5, "10", True, None, 10**30],
    "max_errors_in_a_row": [0, -1, 1.5, "10", True, None, 10**30],
    "max_error_seconds": [0, -1, math.nan, math.inf, "60", True, 1e30],
    "in_order": ["yes", "no", 1, 0],
    "episode_workers": [-1, 1.5, "2", True, None, 10**9],
    "worker_options": [3, "x", ["num_cpus"], None],
    "raise_env_errors": ["no", "yes", 1, 0, None],
    "on_length": ["x", None, 1, True],
    "length_penalty": [math.nan, math.inf, "0.1", True],
    "max_aborts": [-1, 1.5, "3", True, None, 10**30],
    "tool_parser": [3, True, ["hermes"], ""],
    "reasoning_parser": [3, True, ["qwen3"], ""],
    "dataset": [3, "nope", [], {"rows": [1], "epochs": 0}, {"rows": iter([1])}, {"row": [1]}],
}
# fields whose check needs another field set to take effect
CONTEXT: dict[str, dict[str, Any]] = {"length_penalty": {"on_length": "skip"}}

CASES = [(field, value) for field, values in BAD.items() for value in values]


def test_the_table_covers_every_field() -> None:
    assert sorted(BAD) == sorted([*FLAT_NAMES, *WIDE])


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={v!r:.40}" for f, v in CASES])
def test_a_bad_value_fails_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"{NAMED}\.{field}\b") as info:
        PipelineConfig(**{field: value, **CONTEXT.get(field, {})})
    assert len(str(info.value)) < 1000  # a message, not a dump


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={v!r:.40}" for f, v in CASES])
def test_from_dict_fails_the_same_way(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"{NAMED}\.{field}\b"):
        PipelineConfig.from_dict({field: value, **CONTEXT.get(field, {})})


SECTION_CASES = [(f, v) for f, v in CASES if f in FLAT_NAMES]


@pytest.mark.parametrize(
    ("field", "value"), SECTION_CASES, ids=[f"{f}={v!r:.40}" for f, v in SECTION_CASES]
)
def test_inside_its_section_it_fails_the_same_way(field: str, value: Any) -> None:
    section = {field: value, **CONTEXT.get(field, {})}
    with pytest.raises(ValueError, match=rf"{NAMED}\.{field}\b"):
        PipelineConfig.from_dict({FLAT_NAMES[field]: section})


@pytest.mark.parametrize("value", [None, 0.5, 3, 120.0])
def test_env_timeout_accepts_seconds_or_none(value: Any) -> None:
    assert PipelineConfig(env_timeout_s=value).env_timeout_s == value


# -- bounds: a few hundred values outside them, each failing at construction -------------

# flat name -> (lowest, highest) int accepted
INT_RANGES: dict[str, tuple[int, int]] = {
    "group_size": (1, MAX_GROUP_SIZE),
    "redundancy": (0, MAX_REDUNDANCY),
    "seed": (0, MAX_SEED),
    "max_turns": (1, MAX_TURNS),
    "max_length": (2, MAX_LENGTH),
    "history_window": (0, MAX_WINDOW),
    "max_aborts": (0, MAX_ABORTS),
    "concurrency": (1, MAX_CONCURRENCY),
    "env_workers": (0, MAX_CONCURRENCY),
    "max_drops_in_a_row": (1, MAX_DROPS_IN_A_ROW),
    "max_errors_in_a_row": (1, MAX_DROPS_IN_A_ROW),
    "pad_to_multiple_of": (1, MAX_PAD_MULTIPLE),
    "batch_size": (1, MAX_BATCH_SIZE),
    "async_generation_ratio": (0, MAX_RATIO),
    "max_traj_per_env": (1, MAX_TRAJ_PER_ENV),
}
# what must hold for the value to be checked alone (its combinations are valid)
INT_CONTEXT = {"history_window": {"level": "step"}, "batch_size": {"group_size": 1}}


def _outside(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(max_value=low - 1) | st.integers(min_value=high + 1, max_value=10**40)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), field=st.sampled_from(sorted(INT_RANGES)))
def test_an_int_out_of_its_range_fails_at_construction(data: Any, field: str) -> None:
    low, high = INT_RANGES[field]
    value = data.draw(_outside(low, high))
    if field == "max_traj_per_env" and value == -1:
        return  # ROLL's "no limit"
    with pytest.raises(ValueError, match=rf"{NAMED}\.{field}\b") as info:
        PipelineConfig(**{field: value, **INT_CONTEXT.get(field, {})})
    message = str(info.value)
    assert repr(value) in message  # the value...
    assert f"[{low}, {high}]" in message or f">= {low}" in message  # ...and the range


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(["env_timeout_s", "generation_timeout_s"]),
    value=st.floats(max_value=0.0)
    | st.floats(min_value=MAX_TIMEOUT_S, exclude_min=True)
    | st.sampled_from([math.nan, math.inf, -math.inf]),
)
def test_a_timeout_out_of_range_fails_saying_none_is_no_limit(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"EpisodeSettings\.{field}\b") as info:
        PipelineConfig(**{field: value})
    message = str(info.value)
    assert repr(value) in message
    assert f"(0, {MAX_TIMEOUT_S:g}]" in message and "None for no limit" in message


@settings(max_examples=100, deadline=None)
@given(value=st.floats(max_value=0.0) | st.sampled_from([math.nan, math.inf, -math.inf]))
def test_reward_clip_quotes_the_range_it_enforces(value: float) -> None:
    with pytest.raises(ValueError, match=r"EpisodeSettings\.reward_clip\b") as info:
        PipelineConfig(reward_clip=value)
    assert "(0.0, inf)" in str(info.value)  # inf itself is rejected: the range is open


def test_the_values_that_used_to_fail_later_fail_at_once() -> None:
    cases = {
        "concurrency": (10**6, "[1, 65536]"),
        "redundancy": (10**30, "[0, 1024]"),
        "pad_to_multiple_of": (10**30, "[1, 65536]"),
    }
    for field, (value, accepted) in cases.items():
        with pytest.raises(ValueError, match=rf"{field} must be an int <= \d+, got {value}") as i:
            PipelineConfig(**{field: value})
        assert accepted in str(i.value)
    with pytest.raises(ValueError, match=r"history_window=2 needs level='step'"):
        PipelineConfig(history_window=2)
    assert PipelineConfig(history_window=2, level="step").collate.level == "step"


# -- envs: resolved and their own config checked when the config is built -----------------


def test_an_env_config_is_checked_by_the_env_at_construction() -> None:
    with pytest.raises(ValueError, match=r"FrozenLakeConfig\.size must be an int >= 2, got -3"):
        PipelineConfig(envs=[{"name": "frozenlake", "config": {"size": -3}}])
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['sise'\].*valid keys"):
        PipelineConfig(envs=[{"name": "frozenlake", "config": {"sise": 4}}])


def test_an_unknown_name_says_to_register_it_or_use_an_import_path() -> None:
    with pytest.raises(ValueError) as info:
        PipelineConfig(envs="my_game")
    message = str(info.value)
    assert "'my_game'" in message and "registered in this process" in message
    assert "register" in message and "'package.module:Factory'" in message
    assert "any process" in message
    with pytest.raises(ValueError, match=r"cannot import it \(ModuleNotFoundError"):
        PipelineConfig(envs="no_such_package.envs:Game")


def test_an_import_path_names_an_env_in_any_process() -> None:
    from rollpipe.envs import FrozenLake, make

    path = "rollpipe.envs.frozenlake:FrozenLake"
    config = PipelineConfig(envs=[{"name": path, "config": {"size": 3}}])
    assert config.source.envs[0].name == path
    env = make(path, size=3)
    assert isinstance(env, FrozenLake) and env.config.size == 3


# -- sections and flat names -------------------------------------------------------------


def test_flat_names_and_sections_build_the_same_config() -> None:
    flat = PipelineConfig(
        group_size=2,
        batch_size=4,
        max_turns=3,
        concurrency=8,
        level="step",
        history_window=1,
        drop_group="zero_variance",
    )
    sectioned = PipelineConfig(
        source={"group_size": 2},
        episode=EpisodeSettings(max_turns=3, history_window=1),
        rollout={"concurrency": 8},
        groups={"drop_group": "zero_variance"},
        collate={"level": "step"},
        batch_size=4,
    )
    assert flat == sectioned
    assert flat.group_size == flat.source.group_size == 2  # flat reads go to the section
    assert pickle.loads(pickle.dumps(flat)) == flat


def test_a_flat_name_wins_over_its_section() -> None:
    config = PipelineConfig(episode={"max_turns": 3, "max_length": 512}, max_turns=7)
    assert (config.episode.max_turns, config.episode.max_length) == (7, 512)
    record = SourceSettings(group_size=2, seed=5)
    config = PipelineConfig(source=record, seed=9, batch_size=4)
    assert (config.source.group_size, config.source.seed) == (2, 9)


def test_replace_takes_flat_names_and_sections() -> None:
    base = PipelineConfig(episode={"max_turns": 3, "max_length": 512})
    assert base.replace(max_turns=2).episode.max_length == 512
    updated = base.replace(episode={"max_turns": 4})  # a mapping updates the section
    assert (updated.max_turns, updated.max_length) == (4, 512)
    replaced = base.replace(episode=EpisodeSettings(max_turns=4))  # a record replaces it
    assert (replaced.max_turns, replaced.max_length) == (4, 1024)
    with pytest.raises(ValueError, match=r"unknown keys \['max_turn'\]; valid keys"):
        base.replace(max_turn=2)


def test_unknown_keys_list_sections_and_flat_names() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['nope'\]") as info:
        PipelineConfig(nope=1)
    message = str(info.value)
    assert "'episode'" in message and "'max_turns'" in message and "'batch_size'" in message
    with pytest.raises(ValueError, match=r"PipelineConfig\.episode: unknown keys \['turns'\]"):
        PipelineConfig(episode={"turns": 3})
    with pytest.raises(ValueError, match=r"PipelineConfig\.episode must be an EpisodeSettings"):
        PipelineConfig(episode=3)
    with pytest.raises(AttributeError, match=r"no field 'nope'"):
        PipelineConfig().nope  # noqa: B018


@pytest.mark.parametrize(
    ("data", "shown"), [(None, "NoneType None"), ("seed: 1", "str 'seed: 1'"), ([1], "list [1]")]
)
def test_from_dict_needs_a_mapping(data: Any, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"needs a mapping .*, got {re.escape(shown)}"):
        PipelineConfig.from_dict(data)


@pytest.mark.parametrize(
    ("old", "new"), [("max_staleness", "async_generation_ratio"), ("filter", "drop_group")]
)
def test_renamed_keys_give_the_new_name(old: str, new: str) -> None:
    with pytest.raises(ValueError, match=rf"{old} was renamed.*{new}"):
        PipelineConfig.from_dict({old: 1})


def test_the_wait_strategy_needs_a_bound_and_one_batch_per_step() -> None:
    assert PipelineConfig().max_off_policy_strategy == "drop"  # verl's and ROLL's behaviour
    assert PipelineConfig(max_off_policy_strategy="wait").max_off_policy_strategy == "wait"
    with pytest.raises(ValueError, match=r"max_off_policy_strategy='wait' needs async_gen"):
        PipelineConfig(max_off_policy_strategy="wait", async_generation_ratio=None)
    with pytest.raises(ValueError, match=r"'wait' with max_traj_per_env=2"):
        PipelineConfig(
            max_off_policy_strategy="wait", max_traj_per_env=2, concurrency=16, batch_size=16
        )
