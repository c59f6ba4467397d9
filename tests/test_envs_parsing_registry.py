"""Answer parsing and the env registry."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.envs import (
    EnvRegistryError,
    FrozenLake,
    Sokoban,
    available,
    config_keys,
    make,
    parse_action,
    parse_answer,
    register,
)
from rollpipe.envs.parsing import action_lookup, compile_answer_pattern
from rollpipe.envs.registry import _REGISTRY

LOOKUP = action_lookup(("Left", "Down", "Right", "Up"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>Left</answer>", "Left"),
        ("<ANSWER> down </Answer>", "down"),
        ("think <answer>Up</answer> no wait <answer>Right</answer>", "Right"),  # last wins
        ("<answer>\nUp\n</answer>", "Up"),
        ("<answer></answer>", ""),
        ("Left", None),
        ("<answer>Left", None),
        ("", None),
    ],
)
def test_parse_answer(text: str, expected: str | None) -> None:
    assert parse_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("<answer>left</answer>", "Left"),
        ("<answer> RIGHT. </answer>", "Right"),
        ("<answer>'Up'</answer>", "Up"),
        ("<answer>1</answer>", None),  # numbers are not actions
        ("<answer>Left Up</answer>", None),  # one action per step
        ("<answer>jump</answer>", None),
        ("Down", None),
    ],
)
def test_parse_action_is_case_insensitive_and_strict(text: str, action: str | None) -> None:
    assert parse_action(text, LOOKUP)[0] == action


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parse_never_raises(text: str) -> None:
    result = parse_answer(text)
    assert result is None or result == result.strip()
    assert parse_action(text, LOOKUP)[0] in (None, "Left", "Down", "Right", "Up")


def test_custom_pattern_and_format() -> None:
    env = FrozenLake(answer_pattern=r"action:\s*(\w+)", answer_format="action: {action}")
    obs, _ = env.reset(0)
    assert "action: Left" in obs and "<answer>" not in obs
    assert env.step("ACTION: down")[4]["action"] == "Down"
    assert env.step("<answer>Down</answer>")[4]["action_valid"] is False


def test_bad_patterns_and_formats_fail_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="no capture group"):
        compile_answer_pattern("<answer>.*</answer>")
    with pytest.raises(ValueError, match="not a valid regex"):
        FrozenLake(answer_pattern="(")
    with pytest.raises(ValueError, match="answer_format must be a str containing"):
        FrozenLake(answer_format="<answer></answer>")
    with pytest.raises(ValueError, match="does not parse back"):
        Sokoban(answer_format="[{action}]")
    assert parse_answer("<b>Up</b>", re.compile(r"<b>(.*?)</b>")) == "Up"


def test_registry_has_the_builtin_envs() -> None:
    assert {"frozenlake", "sokoban"} <= set(available())
    assert isinstance(make("frozenlake", size=5), FrozenLake)
    env = make("sokoban", dim_room=[7, 7], num_boxes=2)  # lists from YAML are accepted
    assert isinstance(env, Sokoban) and env.config.dim_room == (7, 7)


def test_unknown_env_lists_the_available_ones() -> None:
    with pytest.raises(
        EnvRegistryError, match=r"unknown env 'frozen_lake'.*'frozenlake'.*'sokoban'"
    ):
        make("frozen_lake")


def test_unknown_config_key_lists_the_valid_ones() -> None:
    with pytest.raises(EnvRegistryError) as err:
        make("frozenlake", sise=4, slipery=True)
    message = str(err.value)
    assert "['sise', 'slipery']" in message
    for key in ("size", "slippery", "p_frozen", "max_steps", "format_penalty", "answer_pattern"):
        assert key in message
    assert config_keys("sokoban") is not None and "num_boxes" in config_keys("sokoban")  # type: ignore[operator]


@pytest.mark.parametrize(
    ("name", "config", "field"),
    [
        ("frozenlake", {"size": 1}, "size"),
        ("frozenlake", {"p_frozen": 0.0}, "p_frozen"),
        ("frozenlake", {"slippery": "yes"}, "slippery"),
        ("frozenlake", {"max_steps": 0}, "max_steps"),
        ("frozenlake", {"format_penalty": float("nan")}, "format_penalty"),
        ("sokoban", {"dim_room": (6,)}, "dim_room"),
        ("sokoban", {"dim_room": (4, 4), "num_boxes": 2}, "dim_room"),
        ("sokoban", {"num_boxes": 0}, "num_boxes"),
        ("sokoban", {"success_reward": "10"}, "success_reward"),
    ],
)
def test_bad_config_values_name_the_field(name: str, config: dict[str, Any], field: str) -> None:
    with pytest.raises((ValueError, TypeError), match=field):
        make(name, **config)


def test_register_custom_factory() -> None:
    def tiny_lake(*, seed_offset: int = 0) -> FrozenLake:
        return FrozenLake(size=3)

    register("tiny-lake-test", tiny_lake)
    try:
        assert "tiny-lake-test" in available()
        assert isinstance(make("tiny-lake-test"), FrozenLake)
        with pytest.raises(EnvRegistryError, match=r"valid keys: \['seed_offset'\]"):
            make("tiny-lake-test", size=4)
        with pytest.raises(EnvRegistryError, match="already registered"):
            register("tiny-lake-test", lambda: FrozenLake())
        register("tiny-lake-test", lambda **kw: FrozenLake(**kw), overwrite=True)
        assert config_keys("tiny-lake-test") is None  # **kwargs: the factory checks keys itself
        assert make("tiny-lake-test", size=3).config.size == 3  # type: ignore[union-attr]
    finally:
        _REGISTRY.pop("tiny-lake-test", None)


_TAG_PIECES = ["<answer>", "</answer>", "<ANSWER>", "</Answer>", "<ans", "wer>", "x", " Up ", "\n"]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_TAG_PIECES) | st.text(max_size=3), max_size=14))
def test_linear_tag_scan_finds_what_the_regex_finds(pieces: list[str]) -> None:
    """The default pattern is matched by a linear scan (a regex is quadratic on repeated
    unclosed tags); for any text it returns what ``re.finditer`` returns."""
    import re

    from rollpipe.envs.parsing import DEFAULT_ANSWER_PATTERN, _literal_tags

    text = "".join(pieces)
    assert _literal_tags(DEFAULT_ANSWER_PATTERN) is not None  # the fast path is taken
    matches = list(re.finditer(DEFAULT_ANSWER_PATTERN, text, re.IGNORECASE | re.DOTALL))
    expected = matches[-1].group(1).strip() if matches else None
    assert parse_answer(text) == expected
    assert parse_answer(text, re.compile(DEFAULT_ANSWER_PATTERN)) == (  # other flags: regex
        _regex_last(DEFAULT_ANSWER_PATTERN, text)
    )


def _regex_last(pattern: str, text: str) -> str | None:
    import re

    matches = list(re.finditer(pattern, text))
    return matches[-1].group(1).strip() if matches else None


def test_patterns_that_are_not_literal_tags_use_the_regex() -> None:
    from rollpipe.envs.parsing import _literal_tags

    assert _literal_tags(r"<a>(.*?)</a>") is not None
    for pattern in (r"\[(.*?)\]", r"<a>(.+?)</a>", r"(.*?)</a>", r"A: (\w+)"):
        assert _literal_tags(pattern) is None
    assert parse_answer("go [Left] then [Up]", r"\[(.*?)\]") == "Up"


class _CountingSearch:
    """A tag search that counts the characters it scans: work, which is the same on any
    machine, where a time is not."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern, self.scanned = pattern, 0

    def search(self, text: str, pos: int = 0) -> re.Match[str] | None:
        found = self.pattern.search(text, pos)
        self.scanned += (len(text) if found is None else found.end()) - pos
        return found


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(_TAG_PIECES), min_size=1, max_size=4))
def test_parse_work_is_linear_on_repeated_tags(unit: list[str]) -> None:
    """Any repeated mix of tags (the adversarial case for a regex): the tag searches scan
    each character of the text at most once, counted (a quadratic scan reads the rest of
    the text again for every unclosed tag)."""
    from unittest import mock

    from rollpipe.envs import parsing

    text = "".join(unit) * 4_000
    found = parsing._literal_tags(parsing.DEFAULT_ANSWER_PATTERN)
    assert found is not None
    tags = (_CountingSearch(found[0]), _CountingSearch(found[1]))
    with mock.patch.object(parsing, "_literal_tags", lambda _pattern: tags):
        parse_answer(text)
    scanned = tags[0].scanned + tags[1].scanned
    assert 0 < scanned <= len(text), f"{scanned} characters scanned of {len(text)}: {unit!r}"


def test_other_patterns_see_only_the_end_of_a_long_text() -> None:
    from rollpipe.envs.parsing import REGEX_SCAN_CHARS

    text = "[Left] " + "<" * (2 * REGEX_SCAN_CHARS) + " [Up]"
    assert parse_answer(text, r"\[(.*?)\]") == "Up"
    assert parse_answer("[Left]" + "x" * REGEX_SCAN_CHARS, r"\[(.*?)\]") is None


def test_builtin_names_include_the_tasks_and_the_ecosystem_adapters() -> None:
    """Registered by name without importing any ecosystem package (each is an extra)."""
    import subprocess
    import sys

    from rollpipe.envs import available

    names = {"frozenlake", "sokoban", "task", "calculator"}
    names |= {"gem", "reasoning_gym", "textarena", "openenv"}
    assert names <= set(available())
    probe = (
        "import sys, rollpipe.envs; "
        "print(sorted({'gem', 'reasoning_gym', 'textarena', 'openenv'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # a fresh process: importing rollpipe.envs loads none
