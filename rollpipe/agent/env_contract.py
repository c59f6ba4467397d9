"""The env contract: what an episode calls on an env, and how it reads the env.

An environment speaks text: ``reset(seed)`` gives the first observation and
``step(action_text)`` takes the model's raw response; ``info`` may hold ``action_valid``,
``success`` and ROLL's ``metrics`` / ``metrics_agg_mode`` (see
:mod:`rollpipe.agent.env_metrics`). Blocking envs implement :class:`TextEnv`; envs that
do I/O implement :class:`AsyncTextEnv` (same signatures, ``async``). A :class:`ChatEnv`
talks in chat messages and tool calls. The episode (``rollpipe.agent.episode``) calls
these and nothing else; ``rollpipe.envs`` holds envs that implement them.

Step metrics follow ROLL: a step's ``info`` may hold ``"metrics"`` (name -> number) and
``"metrics_agg_mode"`` (name -> one of ``AGG_MODES``). A trajectory's value of a metric
is its steps' values aggregated by that mode, ``"mean"`` when none is named (ROLL's
``aggregate_metrics``); batch metrics then average it over the trajectories of each env
tag, as ``env/{tag}/{name}``. What an env returns is checked in
:mod:`rollpipe.agent.env_returns`.

Examples:
    >>> from rollpipe.agent.env_contract import TextEnv, env_tools, is_blocking
    >>> class Echo:
    ...     blocking = False  # its calls take microseconds: run them on the loop
    ...     def reset(self, seed): return "say something", {}
    ...     def step(self, action_text): return action_text, 1.0, True, False, {}
    ...     def close(self): pass
    >>> isinstance(Echo(), TextEnv), is_blocking(Echo()), env_tools(Echo())
    (True, False, ())
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rollpipe.agent.actions import AssistantAction, ToolResults
    from rollpipe.agent.records import EpisodeSpec

Info = dict[str, Any]
StepResult = tuple[str, float, bool, bool, Info]
Messages = Sequence[Mapping[str, str]]
"""Chat messages an env answers with: ``user`` or ``tool`` (see ``rollpipe.agent.env_returns``)."""
ChatStepResult = tuple[str | Messages, float, bool, bool, Info]


@runtime_checkable
class TextEnv(Protocol):
    """A blocking text environment: its calls run on env threads, off the event loop,
    unless its own class declares ``blocking = False`` (then they run inline on the loop:
    only for envs whose calls take microseconds and never wait; see ``is_blocking``)."""

    def reset(self, seed: int) -> tuple[str, Info]: ...

    def step(self, action_text: str) -> StepResult: ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncTextEnv(Protocol):
    """A text environment whose ``reset``/``step`` are coroutines (for envs doing I/O)."""

    async def reset(self, seed: int) -> tuple[str, Info]: ...

    async def step(self, action_text: str) -> StepResult: ...

    def close(self) -> None: ...


@runtime_checkable
class ChatEnv(Protocol):
    """An env that answers in chat messages and receives structured actions.

    ``tools`` (read after each ``reset``) are rendered into the prompt by the chat
    template; ``step`` gets an ``AssistantAction`` because the class sets
    ``step_input = "action"``. ``reset`` / ``step`` may be coroutines (as for
    :class:`AsyncTextEnv`); blocking ones run on env threads like any ``TextEnv``.
    """

    step_input: ClassVar[Literal["action"]]
    tools: Sequence[Any]

    def reset(self, seed: int) -> tuple[str | Messages, Info]: ...

    def step(self, action: AssistantAction) -> ChatStepResult: ...

    def close(self) -> None: ...


class EnvStateError(RuntimeError):
    """``step`` called before ``reset`` or after the episode ended (or, for an env whose
    tools the episode runs, with tool calls but not their results)."""


def takes_action(env: object) -> bool:
    """Whether ``env.step`` takes an ``AssistantAction`` (``step_input = "action"``)
    rather than the response text."""
    mode = getattr(env, "step_input", "text")
    if mode not in ("text", "action"):
        raise ValueError(
            f"{type(env).__name__}.step_input is {mode!r}; use 'text' (step gets the "
            "response text) or 'action' (step gets an AssistantAction)"
        )
    return mode == "action"


def is_chat_env(env: object, observation: object) -> bool:
    """Whether an episode of ``env`` talks in chat messages (the env declares tools or
    structured actions, or its first ``observation`` is messages, not a string): text
    envs keep the text conversation, cheapest, without the chat machinery."""
    return not isinstance(observation, str) or bool(env_tools(env)) or takes_action(env)


def env_tools(env: object) -> Sequence[Any]:
    """The tools ``env`` declares (its ``tools`` attribute), ``()`` if none."""
    tools = getattr(env, "tools", None)
    return () if tools is None else tools


class RunsTools(Protocol):
    """What the episode calls to run a turn's tool calls (``rollpipe.agent.tool_runner.
    ToolRunner`` is the one rollpipe has). A runner may also have ``run_inline(action)``:
    the same results at once, or None where a call must be awaited (asked first)."""

    async def run(self, action: AssistantAction) -> ToolResults: ...


def tool_runner(env: object) -> RunsTools | None:
    """The runner of ``env``'s tool calls when the episode is to run them (the env
    declares a ``tool_runner``: ``ToolEnv``, ``TRLEnv``), else None: an env without one
    gets a turn's calls in ``step`` and answers them itself.

    With a runner, the episode runs a turn's calls itself and steps the env with the
    action holding their results (``action.tool_results``): the env decides what they
    mean for the episode (reward, its turn limit), never runs them.
    """
    runner: RunsTools | None = getattr(env, "tool_runner", None)
    if runner is not None and not callable(getattr(runner, "run", None)):
        raise ValueError(
            f"{type(env).__name__}.tool_runner is {type(runner).__name__}; it must be a "
            "rollpipe.agent.tool_runner.ToolRunner (or None: the env answers calls itself)"
        )
    return runner


def is_blocking(env: object) -> bool:
    """Whether ``env``'s calls may block (run them off the event loop): True unless the
    env's own class says ``blocking = False`` in its body (fast, pure-Python envs such as
    the grid puzzles).

    The promise is not inherited: a subclass of ``FrozenLake`` that adds logging or I/O
    to ``step`` runs on env threads, where ``env_timeout_s`` applies, unless it repeats
    the declaration itself. A class may declare it per instance with a ``blocking``
    property in its body (``ToolEnv``: its task's own declaration).
    """
    declared = vars(type(env)).get("blocking", True)
    if isinstance(declared, property):
        declared = declared.__get__(env)
    return declared is not False


def is_async_env(env: object) -> bool:
    """True when ``env.step`` is a coroutine function (await it instead of running it)."""
    return inspect.iscoroutinefunction(getattr(env, "step", None))


EnvForSpec = Callable[["EpisodeSpec"], Any]
"""Builds the environment an episode spec names (the registry's, by default)."""


@runtime_checkable
class EpisodeKind(Protocol):
    """An episode kind that runs its own episode instead of being stepped: the rollout
    hands it the spec, the engine and the settings, and it returns the
    :class:`~rollpipe.agent.records.Trajectory` (``rollpipe.AgentEnv``: an ``openai``
    client agent through the front door). It has no ``reset`` / ``step``; a dataset's
    row reaches it as ``spec.row``."""

    async def run_episode(
        self,
        spec: EpisodeSpec,
        engine: Any,
        chat: Any,
        settings: Any,
        *,
        admit: Any = None,
        env_id: int = 0,
    ) -> Any: ...

    def close(self) -> None: ...


def runs_own_episode(env: object) -> bool:
    """Whether ``env`` is an :class:`EpisodeKind` (it runs its own episode) rather than an
    env the episode steps."""
    return callable(getattr(env, "run_episode", None))


AGG_MODES: tuple[str, ...] = ("mean", "sum", "min", "max", "first", "last")
_AGG_SET = frozenset(AGG_MODES)


_PLAIN_NUMBERS = (float, int, bool)  # the types a step's metrics usually have


def _number(name: str, value: Any) -> float:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise ValueError(
            f"info['metrics'][{name!r}] must be a number (bool, int or float), got "
            f"{type(value).__name__} {value!r}"
        )
    return float(value)


def _plain_metrics(raw: Mapping[Any, Any]) -> dict[str, float] | None:
    """``raw`` as floats where every name is a str and every value a plain number (one
    pass: a tool turn reports six), else None."""
    metrics = {}
    for name, value in raw.items():
        if type(name) is not str or type(value) not in _PLAIN_NUMBERS:
            return None
        metrics[name] = float(value)
    return metrics


def _plain_modes(modes: Mapping[Any, Any]) -> bool:
    """Whether every name is a str and every mode one of :data:`AGG_MODES`."""
    for name, mode in modes.items():
        if type(name) is not str or type(mode) is not str or mode not in _AGG_SET:
            return False
    return True


def step_metrics(info: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """``(metrics, agg_modes)`` of one step's ``info``, checked; both empty when absent.

    Raises ``ValueError`` naming the key when ``metrics`` is not a dict of numbers or a
    mode is not one of ``AGG_MODES``.
    """
    raw = info.get("metrics")
    modes = info.get("metrics_agg_mode")
    if raw is None and modes is None:  # most steps: nothing to check
        return {}, {}
    if raw is None:
        raw = {}
    if modes is None:
        modes = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"info['metrics'] must be a dict of numbers, got {type(raw).__name__}")
    if not isinstance(modes, Mapping):
        raise ValueError(
            f"info['metrics_agg_mode'] must be a dict of names to {AGG_MODES}, got "
            f"{type(modes).__name__}"
        )
    metrics = _plain_metrics(raw)  # the usual: what _number gives
    if metrics is None:
        metrics = {str(k): _number(str(k), v) for k, v in raw.items()}
    if _plain_modes(modes):
        return metrics, dict(modes)  # the usual: what the general path gives
    for k, mode in modes.items():
        if mode not in AGG_MODES:
            raise ValueError(
                f"info['metrics_agg_mode'][{k!r}] is {mode!r}; use one of {list(AGG_MODES)}"
            )
    return metrics, {str(k): str(v) for k, v in modes.items()}


def aggregate_metrics(
    steps: Sequence[Mapping[str, float]], modes: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Each name's values over the steps that reported it, reduced by its mode (mean)."""
    values: dict[str, list[float]] = {}
    for step in steps:
        for name, value in step.items():
            values.setdefault(name, []).append(float(value))
    modes = modes or {}
    out: dict[str, float] = {}
    for name, vs in values.items():
        mode = modes.get(name, "mean")
        if mode == "sum":
            out[name] = float(sum(vs))
        elif mode == "min":
            out[name] = min(vs)
        elif mode == "max":
            out[name] = max(vs)
        elif mode == "first":
            out[name] = vs[0]
        elif mode == "last":
            out[name] = vs[-1]
        else:
            out[name] = sum(vs) / len(vs)
    return out
