"""The tasks ``rollpipe train`` knows: an env and what training and evaluating it need.

Each :class:`TrainTask` names the registered env, the episode's turn cap and tokens per
turn, the model's tool parser (tool envs) and the warm start it starts from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from rollpipe.nodes.episode_source import EnvChoice
from rollpipe.training.evaluate import EVAL_MAX_TURNS
from rollpipe.training.sum_task import SUM_ENV_CONFIG, SUM_EPISODE, held_out_rows, train_rows
from rollpipe.training.tool_expert import TOOL_EPISODE
from rollpipe.training.tool_warm_start import DEFAULT_TOOL_RECIPE

__all__ = ["TASKS", "TrainTask", "train_task"]


def _frozenlake_model() -> Path:
    from rollpipe.training.warm_start import warm_start_model_path

    return warm_start_model_path()


def _lookup_model() -> Path:
    from rollpipe.training.tool_warm_start import LOOKUP_RECIPE, tool_warm_start_model_path

    return tool_warm_start_model_path(LOOKUP_RECIPE)


def _calculator_model() -> Path:
    from rollpipe.training.tool_warm_start import tool_warm_start_model_path

    return tool_warm_start_model_path()


def _sums_model() -> Path:
    from rollpipe.training.sum_warm_start import sum_warm_start_model_path

    return sum_warm_start_model_path()


@attrs.frozen
class TrainTask:
    """An env to train on: ``name`` (registry name), ``max_turns``, ``max_tokens`` per
    turn, ``tool_parser`` (``None`` for text envs), ``warm_start()`` (the model path to
    start from), ``title`` (for the learning curve) and the env's ``config``. A prompt
    dataset task also gives ``dataset()`` (the rows GRPO trains on) and ``held_out()``
    (the rows evaluation plays, never trained on). A tool task may give ``without_tool``:
    the config under which its tool answers nothing useful, evaluated alongside to show
    what the tool is worth."""

    name: str
    max_turns: int
    max_tokens: int
    tool_parser: str | None
    warm_start: Callable[[], Path]
    title: str
    config: Mapping[str, Any] = attrs.field(factory=dict)
    dataset: Callable[[], Sequence[Any]] | None = None  # a prompt dataset's training rows
    held_out: Callable[[], Sequence[Any]] | None = None  # and its held-out rows
    without_tool: Mapping[str, Any] | None = None  # config that takes the tool's answers away

    @property
    def env(self) -> EnvChoice:
        """The env as the pipeline takes it (name and config)."""
        return EnvChoice(self.name, self.config)

    @property
    def env_without_tool(self) -> EnvChoice | None:
        """The env with its tool's answers taken away (None: not a tool task that can)."""
        if self.without_tool is None:
            return None
        return EnvChoice(self.name, {**self.config, **self.without_tool})


TASKS: dict[str, TrainTask] = {
    "frozenlake": TrainTask(
        "frozenlake", EVAL_MAX_TURNS, 24, None, _frozenlake_model, "FrozenLake"
    ),
    "lookup": TrainTask(
        "lookup",
        TOOL_EPISODE["max_turns"],
        TOOL_EPISODE["max_tokens"],
        TOOL_EPISODE["tool_parser"],
        _lookup_model,
        "the lookup tool task",
        without_tool={"tool_available": False},
    ),
    "lookup-agent": TrainTask(
        "rollpipe.training.lookup_agent:lookup_agent_env",
        TOOL_EPISODE["max_turns"],
        TOOL_EPISODE["max_tokens"],
        TOOL_EPISODE["tool_parser"],
        _lookup_model,
        "the lookup task as an openai-client agent",
    ),
    "calculator": TrainTask(
        "calculator",
        TOOL_EPISODE["max_turns"],
        TOOL_EPISODE["max_tokens"],
        TOOL_EPISODE["tool_parser"],
        _calculator_model,
        "the calculator tool task",
        {"digits": DEFAULT_TOOL_RECIPE.digits},  # the digits its warm start learned
    ),
    "sums": TrainTask(
        "task",  # PromptTask on the rows below
        SUM_EPISODE["max_turns"],
        SUM_EPISODE["max_tokens"],
        None,
        _sums_model,
        "single-digit sums (a prompt dataset)",
        SUM_ENV_CONFIG,
        dataset=train_rows,
        held_out=held_out_rows,
    ),
}


def train_task(name: str) -> TrainTask:
    """The task called ``name``; an unknown name lists the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"env={name!r}: rollpipe train knows {sorted(TASKS)}; pick one of them"
        ) from None
