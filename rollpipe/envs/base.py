"""The text-environment protocol and a small base class for grid puzzles.

An environment speaks text: ``reset(seed)`` gives the first observation (instruction,
legend, grid) and ``step(action_text)`` takes the model's raw response. ``info`` always
holds ``action_valid``, ``action`` (canonical action or None) and ``success``; ``step``
adds ``format_penalty_applied``, and may add ROLL's ``metrics`` / ``metrics_agg_mode``
(see :mod:`rollpipe.agent.env_contract`). Blocking envs implement :class:`TextEnv`; envs that
do I/O implement :class:`AsyncTextEnv` (same signatures, ``async``).

A :class:`ChatEnv` talks in chat messages and tool calls: it may declare ``tools``
(callables or OpenAI schemas, rendered by the model's chat template), answer with
``user`` / ``tool`` messages instead of a string, and, when its class says
``step_input = "action"``, receive an :class:`~rollpipe.agent.actions.AssistantAction`
(content, parsed tool calls, reasoning) instead of the raw text.
"""

from __future__ import annotations

import abc
import math
import operator
from typing import Any, ClassVar

import attrs

from rollpipe._utils.checks import int_at_least
from rollpipe.agent.env_contract import (  # the contract the episode calls, re-exported
    AsyncTextEnv,
    ChatEnv,
    ChatStepResult,
    EnvStateError,
    Info,
    Messages,
    StepResult,
    TextEnv,
    env_tools,
    is_async_env,
    is_blocking,
    takes_action,
)
from rollpipe.envs.parsing import (
    DEFAULT_ANSWER_FORMAT,
    DEFAULT_ANSWER_PATTERN,
    action_lookup,
    compile_answer_pattern,
    parse_action,
)

__all__ = [
    "GRID_METRICS_AGG_MODE",
    "AsyncTextEnv",
    "ChatEnv",
    "ChatStepResult",
    "EnvStateError",
    "GridTextEnv",
    "Info",
    "Messages",
    "StepResult",
    "TextEnv",
    "TextEnvConfig",
    "check_seed",
    "env_tools",
    "is_async_env",
    "is_blocking",
    "takes_action",
]

GRID_METRICS_AGG_MODE: dict[str, str] = {
    "action_is_effective": "mean",
    "action_is_valid": "mean",
    "success": "last",
    "format_penalty": "mean",
}
"""How the grid envs' step metrics (ROLL's names) aggregate over a trajectory, as ROLL's."""


def check_seed(seed: object) -> int:
    """``seed`` as a non-negative int (numpy ints accepted), or a ValueError naming it."""
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    value = operator.index(seed)  # type: ignore[arg-type]
    if value < 0:
        raise ValueError(f"seed must be a non-negative int, got {value}; use derive_seed")
    return value


# ---- attrs validators shared by the env configs ------------------------------------


def finite_number(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Validator: a finite int or float (not bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


def optional_str(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """Validator: None or a str."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{attribute.name} must be a str or None, got {type(value).__name__}")


@attrs.frozen(kw_only=True)
class TextEnvConfig:
    """Settings every grid text env shares; subclasses add their own fields."""

    max_steps: int = attrs.field(validator=int_at_least(1))
    format_penalty: float = attrs.field(validator=finite_number)
    answer_pattern: str = attrs.field(default=DEFAULT_ANSWER_PATTERN)
    answer_format: str = attrs.field(default=DEFAULT_ANSWER_FORMAT)

    @answer_pattern.validator
    def _check_pattern(self, attribute: attrs.Attribute[str], value: str) -> None:
        compile_answer_pattern(value)  # raises naming answer_pattern

    @answer_format.validator
    def _check_format(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not isinstance(value, str) or "{action}" not in value:
            raise ValueError(
                f"answer_format must be a str containing '{{action}}', got {value!r}; "
                f"e.g. {DEFAULT_ANSWER_FORMAT!r}"
            )


class GridTextEnv(abc.ABC):
    """Convenience base: parsing, format penalty, step counting, truncation, end checks.

    Subclasses set ``actions``/``name``, and implement ``_reset_state``, ``_apply``,
    ``render``, ``legend``, ``task`` and ``success``. ``step`` reports ROLL's step
    metrics in ``info["metrics"]``: ``action_is_valid``, ``action_is_effective`` (the
    rendered state changed), ``success`` and ``format_penalty`` (the penalty applied).
    """

    actions: ClassVar[tuple[str, ...]]
    name: ClassVar[str]

    def __init__(self, config: TextEnvConfig) -> None:
        self.config = config
        self._lookup = action_lookup(self.actions)
        self._pattern = compile_answer_pattern(config.answer_pattern)
        for action in self.actions:  # the instruction must show an answer we can parse
            example = config.answer_format.replace("{action}", action)
            parsed, _ = parse_action(example, self._lookup, self._pattern)
            if parsed != action:
                raise ValueError(
                    f"answer_format {config.answer_format!r} renders {example!r} for action "
                    f"{action!r}, which answer_pattern {config.answer_pattern!r} does not parse "
                    "back to that action; make the two agree"
                )
        self._example = config.answer_format.replace("{action}", self.actions[0])
        self._seed: int | None = None
        self._steps = 0
        self._done = False
        self._grid = ""  # the last rendered state: an action that changes it is effective

    # -- subclass hooks ------------------------------------------------------------
    @abc.abstractmethod
    def _reset_state(self, seed: int) -> None:
        """Build the initial state for ``seed`` (deterministically)."""

    @abc.abstractmethod
    def _apply(self, action: str) -> tuple[float, bool, str]:
        """Apply a valid ``action``: ``(reward, terminated, feedback)``."""

    @abc.abstractmethod
    def render(self) -> str:
        """The current state as a text grid (one line per row)."""

    @property
    @abc.abstractmethod
    def legend(self) -> str:
        """One line explaining the grid symbols."""

    @property
    @abc.abstractmethod
    def task(self) -> str:
        """One line saying what to achieve."""

    @property
    @abc.abstractmethod
    def success(self) -> bool:
        """Whether the goal state is reached."""

    # -- protocol ------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps taken in this episode (invalid answers count)."""
        return self._steps

    @property
    def done(self) -> bool:
        """True once the episode terminated or was truncated."""
        return self._done

    @property
    def instruction(self) -> str:
        """Task, legend and answer format (the start of the first observation)."""
        choices = ", ".join(self.actions[:-1]) + " or " + self.actions[-1]
        return (
            f"{self.task}\n{self.legend}\nAnswer with one action ({choices}), e.g. {self._example}"
        )

    def reset(self, seed: int) -> tuple[str, Info]:
        """Start an episode; the same ``seed`` always gives the same state and transitions."""
        seed = check_seed(seed)
        self._reset_state(seed)
        self._seed, self._steps, self._done = seed, 0, False
        self._grid = self.render()
        obs = f"{self.instruction}\n{self._grid}"
        return obs, {"action_valid": True, "action": None, "success": self.success, "steps": 0}

    def step(self, action_text: str) -> StepResult:
        """Apply the action parsed from ``action_text``; an invalid one costs the format penalty."""
        if self._seed is None:
            raise EnvStateError(f"{type(self).__name__}.step() called before reset(seed)")
        if self._done:
            raise EnvStateError(
                f"{type(self).__name__}.step() called after the episode ended "
                f"(seed={self._seed}, steps={self._steps}); call reset(seed) to start a new one"
            )
        action, answer = parse_action(action_text, self._lookup, self._pattern)
        if action is None:
            reward, terminated = float(self.config.format_penalty), False
            feedback = "No answer found" if answer is None else "Invalid action"
            feedback += f"; nothing changed. Answer like {self._example}."
        else:
            reward, terminated, feedback = self._apply(action)
        self._steps += 1
        truncated = not terminated and self._steps >= self.config.max_steps
        if truncated:
            feedback += f" Out of steps ({self.config.max_steps})."
        self._done = terminated or truncated
        grid, before = self.render(), self._grid
        self._grid = grid
        success = self.success
        info: Info = {
            "action_valid": action is not None,
            "action": action,
            "success": success,
            "format_penalty_applied": action is None,
            "answer": answer,
            "steps": self._steps,
            "metrics": {
                "action_is_effective": grid != before,
                "action_is_valid": action is not None,
                "success": success,
                "format_penalty": float(self.config.format_penalty) if action is None else 0.0,
            },
            "metrics_agg_mode": dict(GRID_METRICS_AGG_MODE),
        }
        return f"{feedback}\n{grid}", float(reward), terminated, truncated, info

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately a no-op
        """Nothing to release."""
