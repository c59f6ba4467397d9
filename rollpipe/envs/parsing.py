"""Answer parsing: pull the action out of free model text.

The model answers in free text; the action is the content of the *last*
``<answer>...</answer>`` span (the pattern is configurable), matched
case-insensitively. Nothing here raises on any input string.

A pattern of the form ``OPEN(.*?)CLOSE`` with literal tags (the default is one) is
matched by a linear scan for the tags, which finds exactly the spans ``re.finditer``
finds: a regex engine retries the lazy group from every unclosed ``OPEN``, which is
quadratic (160 KB of repeated ``<answer>`` took 30 s), and a model can write that.
Any other pattern goes to the regex engine on the last :data:`REGEX_SCAN_CHARS`
characters only, which bounds its worst case.
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

REGEX_SCAN_CHARS = 16_384
"""How much of the end of a text a pattern that is not ``OPEN(.*?)CLOSE`` with literal
tags is matched on: a regex can take quadratic time, and the answer comes last."""


_FLAGS = re.IGNORECASE | re.DOTALL
_LAZY_SPAN = "(.*?)"
_REGEX_SYNTAX = set("\\.^$*+?{}[]|()")


@functools.lru_cache(maxsize=64)
def _literal_tags(pattern: str) -> tuple[re.Pattern[str], re.Pattern[str]] | None:
    """For ``OPEN(.*?)CLOSE`` with literal, non-empty tags: the two tags as
    case-insensitive searches; None for any other pattern."""
    open_tag, sep, close_tag = pattern.partition(_LAZY_SPAN)
    if not sep or not open_tag or not close_tag:
        return None
    if _REGEX_SYNTAX & set(open_tag + close_tag):
        return None
    flags = re.IGNORECASE
    return re.compile(re.escape(open_tag), flags), re.compile(re.escape(close_tag), flags)


def _last_span(text: str, tags: tuple[re.Pattern[str], re.Pattern[str]]) -> str | None:
    """The content of the last ``OPEN...CLOSE`` span as ``finditer`` would find it: each
    span starts at the first OPEN after the previous span and ends at the first CLOSE."""
    open_tag, close_tag = tags
    found, pos = None, 0
    while (start := open_tag.search(text, pos)) is not None:
        end = close_tag.search(text, start.end())
        if end is None:  # no CLOSE after this OPEN, so none after any later OPEN
            break
        found, pos = text[start.end() : end.start()], end.end()
    return found


@functools.lru_cache(maxsize=64)
def compile_answer_pattern(pattern: str) -> re.Pattern[str]:
    """Compile ``pattern`` case-insensitively (DOTALL); it needs at least one capture group."""
    if not isinstance(pattern, str):
        raise TypeError(f"answer_pattern must be a str regex, got {type(pattern).__name__}")
    try:
        compiled = re.compile(pattern, _FLAGS)
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
    then answers is read by its final answer. Non-str ``text`` gives None. Work is
    linear in the text for literal tags; other patterns see its last
    :data:`REGEX_SCAN_CHARS` characters.
    """
    if not isinstance(text, str):
        return None
    same_flags = isinstance(pattern, str) or pattern.flags & _FLAGS == _FLAGS
    tags = _literal_tags(pattern if isinstance(pattern, str) else pattern.pattern)
    if tags is not None and same_flags:
        span = _last_span(text, tags)
        return None if span is None else span.strip()
    compiled = compile_answer_pattern(pattern) if isinstance(pattern, str) else pattern
    last: re.Match[str] | None = None
    for last in compiled.finditer(text[-REGEX_SCAN_CHARS:]):  # noqa: B007 - keep the final match
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
