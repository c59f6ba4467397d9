"""Chat messages an env answers with, checked where it returns them.

A chat env's ``reset`` / ``step`` may return, instead of an observation string, a list
of messages: ``{"role": "user", "content": str}`` or ``{"role": "tool", "content": str,
"tool_call_id": str, "name": str}`` (id and name optional: templates that show them need
them). A string is one user message. Anything else fails the episode with a message
naming the env call, the index and the field.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ENV_ROLES", "as_messages", "check_messages", "messages_text"]

ENV_ROLES = ("user", "tool")
_OPTIONAL = ("tool_call_id", "name")


def check_messages(where: str, value: Any) -> tuple[dict[str, str], ...]:
    """``value`` (a list of message dicts) as checked plain dicts; ``ValueError`` naming
    ``where`` (e.g. ``"Calc.step: observation"``), the index and the field otherwise."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise ValueError(
            f"{where} must be a str or a non-empty list of chat messages, got "
            f"{type(value).__name__} {reprlib.repr(value)}"
        )
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}[{i}] must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ENV_ROLES:
            raise ValueError(f"{where}[{i}]['role'] is {role!r}; an env answers as {ENV_ROLES}")
        if not isinstance(content, str):
            raise ValueError(f"{where}[{i}]['content'] must be a str, got {type(content).__name__}")
        checked = {"role": role, "content": content}
        for key in _OPTIONAL:
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise ValueError(f"{where}[{i}][{key!r}] must be a str, got {message[key]!r}")
                checked[key] = message[key]
        unknown = sorted(set(message) - {"role", "content", *_OPTIONAL})
        if unknown:
            raise ValueError(f"{where}[{i}] has unknown keys {unknown}")
        out.append(checked)
    return tuple(out)


def as_messages(observation: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """An observation as messages: a string is one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return [dict(m) for m in observation]


def messages_text(observation: str | Sequence[Mapping[str, str]]) -> str:
    """An observation as one string (``Turn.observation``, step rows' ``observations``):
    a string as it is; messages as their contents, tool results prefixed with the tool."""
    if isinstance(observation, str):
        return observation
    parts = []
    for m in observation:
        head = f"[{m['role']} {m['name']}] " if m["role"] == "tool" and m.get("name") else ""
        parts.append(head + m["content"])
    return "\n".join(parts)
