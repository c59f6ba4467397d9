"""What an env must return, and the chat messages it may answer with, checked where it
returns them.

``reset(seed)`` returns ``(observation: str, info: dict)``; ``step(action_text)`` returns
``(observation: str, reward: real number, terminated: bool, truncated: bool, info:
dict)``; a chat env's observation may be a list of chat messages instead of a string
(below), returned as a tuple of checked message dicts. A return
of another shape, a non-finite reward (NaN, inf, or beyond float32,
where rows store it) or a reward that is not a number (``"1.5"``) fails the *episode*
like an env that raised — its group is dropped and replaced, counted under
``dropped/errored`` — with a message naming the env class, the call, the field and the
value with its type, instead of ending the whole stream with a bare TypeError later::

    FrozenLake.step: reward is nan; a reward must be a finite number
    FrozenLake.step: observation must be a str, got int 5

A chat env's ``reset`` / ``step`` may return, instead of an observation string, a list
of messages: ``{"role": "user", "content": str}`` or ``{"role": "tool", "content": str,
"tool_call_id": str, "name": str}`` (id and name optional: templates that show them need
them). A user message's ``content`` may also be a list of content parts, text and images
(``rollpipe.agent.content``: ``{"type": "text", "text": str}``, ``{"type": "image",
"image": PIL image or H x W x 3 uint8 array}``); an episode whose observations hold
images runs an image conversation (``rollpipe.vision.conversation``). A string is one
user message. Anything else fails the episode with a message naming the env call, the
index and the field.

Examples:
    >>> import numpy as np
    >>> image = np.zeros((48, 64, 3), dtype=np.uint8)
    >>> msgs = check_messages("Lake.reset: observation", [{"role": "user", "content": [
    ...     {"type": "text", "text": "Where next?"}, {"type": "image", "image": image}]}])
    >>> messages_text(msgs), has_images(msgs), has_images("text")
    ('Where next?\\n<image 64x48>', True, False)
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollpipe.agent.content import check_parts, part_text

__all__ = [
    "ENV_ROLES",
    "EnvReturnError",
    "as_messages",
    "check_messages",
    "check_reset",
    "check_step",
    "clip_reward",
    "has_images",
    "messages_text",
]

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_SHAPES = {
    "reset": "(observation: str, info: dict)",
    "step": "(observation: str, reward: float, terminated: bool, truncated: bool, info: dict)",
}


ENV_ROLES = ("user", "tool")
_OPTIONAL = ("tool_call_id", "name")
_IN_ORDER = ("role", "content", *_OPTIONAL)  # a checked message's keys, in its order
_KNOWN_KEYS = frozenset(_IN_ORDER)


def check_messages(where: str, value: Any) -> tuple[dict[str, Any], ...]:
    """``value`` (a list of message dicts) as checked plain dicts; ``ValueError`` naming
    ``where`` (e.g. ``"Calc.step: observation"``), the index and the field otherwise. A
    user message's content may be a list of content parts (checked, as plain dicts)."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise ValueError(
            f"{where} must be a str or a non-empty list of chat messages, got "
            f"{type(value).__name__} {reprlib.repr(value)}"
        )
    out = []
    for i, message in enumerate(value):
        if _plain(message):  # the usual message: what the checks below give, at once
            out.append({key: message[key] for key in _IN_ORDER if key in message})
            continue
        if not isinstance(message, Mapping):
            raise ValueError(f"{where}[{i}] must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ENV_ROLES:
            raise ValueError(f"{where}[{i}]['role'] is {role!r}; an env answers as {ENV_ROLES}")
        if isinstance(content, (list, tuple)) and role == "user":
            content = check_parts(content, f"{where}[{i}]['content']")
        elif not isinstance(content, str):
            also = " or (a user message) a list of content parts" if role == "user" else ""
            raise ValueError(
                f"{where}[{i}]['content'] must be a str{also}, got {type(content).__name__}"
            )
        checked: dict[str, Any] = {"role": role, "content": content}
        for key in _OPTIONAL:
            field = message.get(key)
            if field is not None:
                if not isinstance(field, str):
                    raise ValueError(f"{where}[{i}][{key!r}] must be a str, got {field!r}")
                checked[key] = field
        if not message.keys() <= _KNOWN_KEYS:
            unknown = sorted(set(message) - _KNOWN_KEYS)
            raise ValueError(f"{where}[{i}] has unknown keys {unknown}")
        out.append(checked)
    return tuple(out)


def _plain(message: Any) -> bool:
    """Whether ``message`` is a dict of known keys whose values are all strings, with a
    content and a role an env answers as: the checks of :func:`check_messages` pass it."""
    return (
        type(message) is dict
        and message.get("role") in ENV_ROLES
        and "content" in message
        and message.keys() <= _KNOWN_KEYS
        and all(type(v) is str for v in message.values())
    )


def as_messages(observation: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """An observation as messages: a string is one user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return [dict(m) for m in observation]


def has_images(observation: Any) -> bool:
    """Whether a checked observation (a str or checked messages) holds an image part."""
    if isinstance(observation, str):
        return False
    return any(
        not isinstance(m["content"], str) and any(p["type"] == "image" for p in m["content"])
        for m in observation
    )


def messages_text(observation: str | Sequence[Mapping[str, Any]]) -> str:
    """An observation as one string (``Turn.observation``, step rows' ``observations``):
    a string as it is; messages as their contents, tool results prefixed with the tool,
    content parts joined by newlines with each image shown as ``<image WxH>``."""
    if isinstance(observation, str):
        return observation
    parts = []
    for m in observation:
        head = f"[{m['role']} {m['name']}] " if m["role"] == "tool" and m.get("name") else ""
        content = m["content"]
        if not isinstance(content, str):
            content = "\n".join(part_text(p) for p in content)
        parts.append(head + content)
    return "\n".join(parts)


class EnvReturnError(TypeError):
    """An env returned something the episode cannot use (see the module doc)."""


def _got(value: Any) -> str:
    """``int 5``, ``str '1.5'``, ``NoneType None``: the value's type, then the value."""
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _fail(env: Any, call: str, problem: str) -> EnvReturnError:
    return EnvReturnError(f"{type(env).__name__}.{call}: {problem}")


def _wrong_type(env: Any, call: str, field: str, wanted: str, value: Any) -> EnvReturnError:
    return _fail(env, call, f"{field} must be {wanted}, got {_got(value)}")


def _flag(env: Any, name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, numbers.Integral) and value in (0, 1)
    ):
        return bool(value)
    raise _wrong_type(env, "step", name, "a bool", value)


def _as_float(reward: Any) -> float:
    """``float(reward)``, ±inf for an integer too large for a float."""
    try:
        return float(reward)
    except OverflowError:
        return math.inf if reward > 0 else -math.inf


def clip_reward(result: Any, limit: float) -> tuple[Any, bool]:
    """``result`` (a step return) with a numeric reward beyond ``±limit`` (±inf too)
    replaced by ``±limit``, and whether it was; anything else (NaN, a non-number, a
    malformed return) is left for :func:`check_step` to reject."""
    if not (isinstance(result, tuple) and len(result) == 5):
        return result, False
    reward = result[1]
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
        return result, False
    value = _as_float(reward)
    if math.isnan(value) or abs(value) <= limit:
        return result, False
    return (result[0], math.copysign(limit, value), *result[2:]), True


def _check_tuple(env: Any, call: str, result: Any, n: int) -> None:
    if isinstance(result, tuple) and len(result) == n:
        return
    size = f" of {len(result)}" if isinstance(result, (tuple, list)) else ""
    got = f"{type(result).__name__}{size} {reprlib.repr(result)}"
    raise _fail(
        env, call, f"the return must be a {n}-tuple, got {got}; {call} must return {_SHAPES[call]}"
    )


def _observation(env: Any, call: str, value: Any) -> Any:
    """A str as it is, a list of chat messages checked, anything else refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        try:
            return check_messages(f"{type(env).__name__}.{call}: observation", value)
        except ValueError as exc:
            raise EnvReturnError(str(exc)) from None
    raise _wrong_type(env, call, "observation", "a str", value)


def check_reset(env: Any, result: Any) -> tuple[Any, Mapping[str, Any]]:
    _check_tuple(env, "reset", result, 2)
    observation, info = result
    observation = _observation(env, "reset", observation)
    if not isinstance(info, Mapping):
        raise _wrong_type(env, "reset", "info", "a dict", info)
    return observation, info


def check_step(env: Any, result: Any) -> tuple[Any, float, bool, bool, Mapping[str, Any]]:
    _check_tuple(env, "step", result, 5)
    observation, reward, terminated, truncated, info = result
    if (  # the usual return, accepted without the general checks: the same result
        type(observation) is str
        and type(reward) is float
        and -_FLOAT32_MAX <= reward <= _FLOAT32_MAX  # finite (NaN compares false)
        and (terminated is True or terminated is False)
        and (truncated is True or truncated is False)
        and type(info) is dict
    ):
        return result
    observation = _observation(env, "step", observation)
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
        raise _wrong_type(env, "step", "reward", "a real number", reward)
    value = _as_float(reward)
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        beyond = (
            f", beyond float32 (|reward| <= {_FLOAT32_MAX:.4g})" if math.isfinite(value) else ""
        )
        raise _fail(
            env,
            "step",
            f"reward is {reprlib.repr(reward)}{beyond}; a reward must be a finite number",
        )
    if not isinstance(info, Mapping):
        raise _wrong_type(env, "step", "info", "a dict", info)
    return (
        observation,
        value,
        _flag(env, "terminated", terminated),
        _flag(env, "truncated", truncated),
        info,
    )
