"""What an env must return, checked where it returns it.

``reset(seed)`` returns ``(observation: str, info: dict)``; ``step(action_text)`` returns
``(observation: str, reward: real number, terminated: bool, truncated: bool, info:
dict)``. A return of another shape, a non-finite reward (NaN, inf, or beyond float32,
where rows store it) or a reward that is not a number (``"1.5"``) fails the *episode*
like an env that raised — its group is dropped and replaced, counted under
``dropped/errored`` — with a message naming the env, the field and the value, instead of
ending the whole stream with a bare TypeError later.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["EnvReturnError", "check_reset", "check_step", "clip_reward"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)


class EnvReturnError(TypeError):
    """An env returned something the episode cannot use (see the module doc)."""


def _fail(env: Any, call: str, what: str, value: Any) -> EnvReturnError:
    return EnvReturnError(
        f"{type(env).__name__}.{call} returned {what}, got {reprlib.repr(value)}; "
        f"{call} must return "
        + (
            "(observation: str, info: dict)"
            if call == "reset"
            else "(observation: str, reward: float, terminated: bool, truncated: bool, info: dict)"
        )
    )


def _flag(env: Any, name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, numbers.Integral) and value in (0, 1)
    ):
        return bool(value)
    raise _fail(env, "step", f"{name} that is not a bool", value)


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


def check_reset(env: Any, result: Any) -> tuple[str, Mapping[str, Any]]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise _fail(env, "reset", "something other than a 2-tuple", result)
    observation, info = result
    if not isinstance(observation, str):
        raise _fail(env, "reset", "an observation that is not a str", observation)
    if not isinstance(info, Mapping):
        raise _fail(env, "reset", "an info that is not a dict", info)
    return observation, info


def check_step(env: Any, result: Any) -> tuple[str, float, bool, bool, Mapping[str, Any]]:
    if not (isinstance(result, tuple) and len(result) == 5):
        raise _fail(env, "step", "something other than a 5-tuple", result)
    observation, reward, terminated, truncated, info = result
    if not isinstance(observation, str):
        raise _fail(env, "step", "an observation that is not a str", observation)
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, numbers.Real):
        raise _fail(env, "step", "a reward that is not a real number", reward)
    value = _as_float(reward)
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise _fail(env, "step", "a reward that is not finite in float32", reward)
    if not isinstance(info, Mapping):
        raise _fail(env, "step", "an info that is not a dict", info)
    return (
        observation,
        value,
        _flag(env, "terminated", terminated),
        _flag(env, "truncated", truncated),
        info,
    )
