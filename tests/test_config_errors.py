"""Every PipelineConfig field, given bad values (type confusions included: ``"no"`` for a
bool, ``1.5`` for an int, negative counts): each fails at construction with a message
naming the field. The table must cover every field, so a new field needs its row."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from rollpipe.config import PipelineConfig

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
    ],
    "group_size": [0, -1, 1.5, "4", True, None],
    "batch_size": [0, -4, 1.5, "16", True, None, 6],
    "num_groups": [0, -1, 1.5, "3", True],
    "redundancy": [-1, 1.5, "1", True, None],
    "seed": [-1, 1.5, "0", True, None],
    "max_turns": [0, 1.5, "5", True, None],
    "max_length": [0, -1, 1.5, "1024", True, None],
    "concurrency": [0, 1.5, "32", True, None],
    "env_workers": [-1, 1.5, "2", True, None],
    "env_timeout_s": [0, -1, math.nan, math.inf, "60", True],
    "generation_timeout_s": [0, -1, math.nan, math.inf, "60", True],
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
    "history_window": [-1, 1.5, "2", True],
    "layout": ["x", None, 1],
    "level": ["x", None, 1],
    "pad_to_multiple_of": [0, -1, 1.5, "8", True],
    "keep_group": [3, "nope", "zero_variance", True, "os:no_such_function"],
    "drop_group": [3, "nope", "scores_differ", True],
    "async_generation_ratio": [-1, 1.5, "0", True],
    "max_traj_per_env": [0, -2, 1.5, "1", True],
    "max_drops_in_a_row": [0, -1, 1.5, "10", True, None],
    "in_order": ["yes", "no", 1, 0],
    "raise_env_errors": ["no", "yes", 1, 0, None],
    "on_length": ["x", None, 1, True],
    "length_penalty": [math.nan, math.inf, "0.1", True],
}
# fields whose check needs another field set to take effect
CONTEXT: dict[str, dict[str, Any]] = {"length_penalty": {"on_length": "skip"}}

CASES = [(field, value) for field, values in BAD.items() for value in values]


def test_the_table_covers_every_field() -> None:
    assert sorted(BAD) == sorted(f.name for f in attrs.fields(PipelineConfig))


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={v!r}" for f, v in CASES])
def test_a_bad_value_fails_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"PipelineConfig\.{field}\b") as info:
        PipelineConfig(**{field: value, **CONTEXT.get(field, {})})
    assert len(str(info.value)) < 1000  # a message, not a dump


@pytest.mark.parametrize(("field", "value"), CASES, ids=[f"{f}={v!r}" for f, v in CASES])
def test_from_dict_fails_the_same_way(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"PipelineConfig\.{field}\b"):
        PipelineConfig.from_dict({field: value, **CONTEXT.get(field, {})})


@pytest.mark.parametrize("value", [None, 0.5, 3, 120.0])
def test_env_timeout_accepts_seconds_or_none(value: Any) -> None:
    assert PipelineConfig(env_timeout_s=value).env_timeout_s == value
