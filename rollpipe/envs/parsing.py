"""Answer parsing: pull the action out of free model text.

The model answers in free text; the action is the content of the *last*
``<answer>...</answer>`` span (the pattern is configurable), matched
case-insensitively. Nothing here raises on any input string.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping

DEFAULT_ANSWER_PATTERN = r"<answer>(.*?)</answer>"
"""Regex with one capture group around the answer; compiled case-insensitive, DOTALL."""

DEFAULT_ANSWER_FORMAT = "<answer>{action}</answer>"
"""How the instruction shows an answer; ``{action}`` is replaced by an action name."""

_STRIP_CHARS = " \t\r\n.!\"'`*"


@functools.lru_cache(maxsize=64)
def compile_answer_pattern(pattern: str) -> re.Pattern[str]:
    """Compile ``pattern`` case-insensitively (DOTALL); it needs at least one capture group."""
    if not isinstance(pattern, str):
        raise TypeError(f"answer_pattern must be a str regex, got {type(pattern).__name__}")
    try:
        compiled = re.compile(pattern, re.IGNORECASE | re.DOTALL)
    except re.error as exc:
        raise ValueError(f"answer_pattern {pattern!r} is not a valid regex: {exc}") from exc
    if compiled.groups < 1:
        raise ValueError(
            f"answer_pattern {pattern!r} has no capture group; wrap the answer in (...), "
            f"e.g. {DEFAULT_ANSWER_PATTERN!r}"
        )
    return compiled


def parse_answer(text: str, pattern: str | re.Pattern[str] = DEFAULT_ANSWER_PATTERN) -> str | None:
    """The stripped content of the last match of ``pattern`` in ``text``, or None.

    The last match wins, so a model that mentions the format while thinking and
    then answers is read by its final answer. Non-str ``text`` gives None.
    """
    if not isinstance(text, str):
        return None
    compiled = compile_answer_pattern(pattern) if isinstance(pattern, str) else pattern
    last: re.Match[str] | None = None
    for last in compiled.finditer(text):  # noqa: B007 - keep the final match
        pass
    if last is None:
        return None
    group = last.group(1)
    return None if group is None else group.strip()


def action_lookup(actions: Iterable[str]) -> dict[str, str]:
    """Map the normalized (lower-case) form of each action name to its canonical spelling."""
    return {normalize_action(a): a for a in actions}


def normalize_action(answer: str) -> str:
    """Lower-case ``answer`` and strip whitespace, quotes and trailing ``.``/``!``."""
    return answer.strip(_STRIP_CHARS).lower()


def parse_action(
    text: str,
    lookup: Mapping[str, str],
    pattern: str | re.Pattern[str] = DEFAULT_ANSWER_PATTERN,
) -> tuple[str | None, str | None]:
    """``(action, answer)``: the canonical action (None if invalid) and the raw answer text."""
    answer = parse_answer(text, pattern)
    if answer is None:
        return None, None
    return lookup.get(normalize_action(answer)), answer
