"""TRL environments in rollpipe: a class written for ``GRPOTrainer(environment_factory=...)``
runs unchanged as a rollpipe tool env.

TRL's contract (trl 1.16, ``GRPOTrainer.__init__`` / ``_generate_and_score_completions``):
the factory returns an instance whose public methods (not ``reset`` / ``get_reward``, not
``_``-prefixed) are the tools, each with type hints and a docstring with ``Args:``;
``reset(**row)`` gets the dataset row and returns ``None`` or a string appended to the
row's last prompt message; an optional ``get_reward()`` (may be async) scores the
finished rollout. A ``{name: factory}`` mapping picks the factory by the row's
``environment`` field, which ``reset`` does not get.

``TRLEnv`` does the same per episode: a fresh instance (one per episode, as TRL's one per
rollout), ``reset(**row)`` with the source's dataset row (``PipelineConfig(dataset=...)``;
without one ``reset()``), the prompt from ``row["prompt"]`` plus the observation, the
instance's methods as the episode's tools (run by the episode with the env's
``tool_runner``), and ``get_reward()``
as the reward when the model answers without a tool call or runs out of tool turns.
Register it as an env (``CounterEnv`` being such a class)::

    from rollpipe.envs import register
    register("counter", lambda: TRLEnv(CounterEnv))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

from rollpipe.agent.actions import AssistantAction
from rollpipe.agent.tool_runner import DEFAULT_MAX_RESULT_CHARS, ToolRunner, results_of
from rollpipe.agent.tools import ToolSet
from rollpipe.envs.base import EnvStateError, Info, check_seed

__all__ = ["TRLEnv", "trl_tools"]

NOT_TOOLS = ("reset", "get_reward")
ROUTE_KEY = "environment"  # TRL's field naming a row's environment in a mapping

Factory = Callable[[], Any]


def trl_tools(instance: Any) -> list[Callable[..., Any]]:
    """``instance``'s tools as TRL sees them: the public functions of its class, bound."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


def _prompt(row: Mapping[str, Any] | None, observation: Any) -> str | list[dict[str, str]]:
    """The first messages: the row's ``prompt`` (a str or chat messages) with
    ``observation`` appended to its last message, as TRL does."""
    extra = "" if observation is None else observation
    if not isinstance(extra, str):
        raise ValueError(
            f"TRLEnv: reset() returned {type(extra).__name__}; a TRL env's reset returns "
            "None or a str (multimodal observations are not supported)"
        )
    prompt = None if row is None else row.get("prompt")
    if prompt is None or prompt == "":
        return extra
    if isinstance(prompt, str):
        return prompt + extra
    messages = [dict(m) for m in prompt]
    roles = sorted({str(m.get("role")) for m in messages} - {"user", "tool"})
    if roles:
        raise ValueError(
            f"TRLEnv: the row's prompt has {roles} message(s); an env's messages are 'user' "
            "ones: set the system message with EpisodeSettings(system_prompt=...)"
        )
    messages[-1]["content"] = str(messages[-1]["content"]) + extra
    return messages


class TRLEnv:
    """A TRL ``environment_factory`` class (or ``{name: factory}``) as a rollpipe env.

    Args:
        factory: returns a TRL environment instance (usually the class itself), or a
            mapping ``name -> factory`` routed by each row's ``environment`` field.
        max_tool_turns: turns of tool calls before the episode ends (scored by
            ``get_reward`` as TRL scores a rollout cut at ``max_tool_calling_iterations``).
        tool_timeout_s: limit of one tool call (None: none).
        max_threads: worker threads for blocking tools.
        max_result_chars: a tool result longer than this is cut (None: no limit).

    Examples:
        >>> import asyncio, attrs
        >>> from rollpipe.agent.actions import ToolCall
        >>> class Counter:  # for TRL's environment_factory: its public methods are the tools
        ...     def reset(self, **row):
        ...         self.count = 0
        ...         return " Count to 2."
        ...     def increment(self, step: int) -> int:
        ...         '''Add to the counter.
        ...
        ...         Args:
        ...             step: how much to add
        ...         '''
        ...         self.count += step
        ...         return self.count
        ...     def get_reward(self) -> float:
        ...         return float(self.count == 2)
        >>> env = TRLEnv(Counter)
        >>> env.reset(seed=0, row={"prompt": "Hi."}), env.tools.names  # TRL's reset(**row)
        (('Hi. Count to 2.', {'success': False}), ('increment',))
        >>> call = ToolCall.from_json("call_0", "increment", '{"step": 2}')
        >>> calls = AssistantAction("", "", [call])  # run as the episode runs them:
        >>> calls = attrs.evolve(calls, tool_results=asyncio.run(env.tool_runner.run(calls)))
        >>> asyncio.run(env.step(calls))[0][0]["content"]
        '2'
        >>> asyncio.run(env.step(AssistantAction.plain("Done.")))[:3]  # answered: get_reward()
        ('', 1.0, True)
        >>> env.close()
    """

    step_input: ClassVar[Literal["action"]] = "action"

    def __init__(
        self,
        factory: Factory | Mapping[str, Factory],
        *,
        max_tool_turns: int = 4,
        tool_timeout_s: float | None = 10.0,
        max_threads: int = 2,
        max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS,
    ) -> None:
        factories: dict[str | None, Factory] = {None: factory} if callable(factory) else {}
        if isinstance(factory, Mapping):
            factories = {str(name): f for name, f in factory.items()}
        bad = {k: f for k, f in factories.items() if not callable(f)}
        if bad or not factories:
            raise ValueError(
                f"TRLEnv: factory must be a callable returning a TRL env (its class), or a "
                f"non-empty mapping name -> such a callable; got {factory!r}"
            )
        if not isinstance(max_tool_turns, int) or max_tool_turns < 1:
            raise ValueError(f"TRLEnv.max_tool_turns must be an int >= 1, got {max_tool_turns!r}")
        self.factories = factories
        self.max_tool_turns = max_tool_turns
        self.tools = ToolSet(())  # the current episode's (read by rollpipe after reset)
        self.tool_runner = ToolRunner(
            self.tools,
            timeout_s=tool_timeout_s,
            max_threads=max_threads,
            max_result_chars=max_result_chars,
        )
        self.instance: Any = None  # the current episode's TRL env
        self._tool_turns = -1  # -1: not reset, or the episode ended

    def _new_instance(self, row: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        """A fresh instance of the row's environment, and the kwargs for its reset."""
        kwargs = {} if row is None else dict(row)
        if None in self.factories:
            return self.factories[None](), kwargs
        name = kwargs.pop(ROUTE_KEY, None)
        if name not in self.factories:
            raise ValueError(
                f"TRLEnv: the row's {ROUTE_KEY!r} field is {name!r}; expected one of "
                f"{sorted(k for k in self.factories if k is not None)} (TRL's routing field)"
            )
        return self.factories[name](), kwargs

    def reset(self, seed: int, row: Any = None) -> tuple[Any, Info]:
        """A fresh TRL env, reset with the dataset ``row``'s fields (TRL's ``reset(**row)``)."""
        check_seed(seed)
        if row is not None and not isinstance(row, Mapping):
            raise ValueError(
                f"TRLEnv: a dataset row must be a dict of fields (TRL's example), got "
                f"{type(row).__name__}"
            )
        instance, kwargs = self._new_instance(row)
        if not callable(getattr(instance, "reset", None)):
            raise ValueError(f"TRLEnv: {type(instance).__name__} has no reset(); TRL needs one")
        observation = instance.reset(**kwargs)
        self.instance = instance
        self.tools = self.tool_runner.tools = ToolSet(trl_tools(instance))
        self._tool_turns = 0
        return _prompt(row, observation), {"success": False}

    async def step(self, action: AssistantAction) -> tuple[Any, float, bool, bool, Info]:
        """Answer the turn's tool calls with their results (``action.tool_results``, run by
        the episode); an answer (or the last tool turn) ends the episode with
        ``get_reward()``."""
        if self._tool_turns < 0:
            raise EnvStateError("TRLEnv.step() called before reset(seed) or after the end")
        if action.calls_tools:
            messages, counts = results_of(action, self)
            self._tool_turns += 1
            info: Info = {
                "action_valid": counts["tool/malformed"] == 0,
                "metrics": counts,
                "metrics_agg_mode": dict.fromkeys(counts, "sum"),
            }
            if self._tool_turns < self.max_tool_turns:
                return messages, 0.0, False, False, {**info, "success": False}
            reward = await self._reward()
            return messages, reward, False, True, {**info, "success": reward > 0}
        reward = await self._reward()
        return "", reward, True, False, {"success": reward > 0, "answer": action.content}

    async def _reward(self) -> float:
        """``get_reward()`` of the episode's instance (0 without one, as TRL's NaN: no
        score), run off the event loop unless it is a coroutine."""
        self._tool_turns = -1
        get_reward = getattr(self.instance, "get_reward", None)
        if get_reward is None:
            return 0.0
        if inspect.iscoroutinefunction(get_reward):
            value = await get_reward()
        else:
            runner = self.tool_runner
            value = await runner.threads.call(get_reward, timeout=runner.timeout_s)
        return float(value)

    def close(self) -> None:
        self.tool_runner.close()
