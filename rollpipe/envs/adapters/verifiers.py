"""verifiers environments through rollpipe's front door: ``VerifiersEnv(taskset=...)``.

verifiers 0.4 (``import verifiers.v1 as vf``) drives a model through an OpenAI client:
its harness program calls verifiers' interception server, which relays each request to
the run's endpoint. ``VerifiersEnv`` is an :class:`~rollpipe.frontdoor.agent.AgentEnv`
whose agent runs one verifiers episode (``vf.Env.run_episode``) with that endpoint set
to the episode's front-door session, so every call the harness makes becomes token-exact
rows, and maps:

* observation: the task's prompt (and system prompt) as the harness sends it; in a
  multi-turn env (a ``vf.Env`` whose ``run`` talks through ``interaction().turn(...)``)
  each user turn the env sends; tool results from the task's ``vf.Toolset`` tools;
* action: the model's reply, tool calls parsed by ``EpisodeSettings.tool_parser``;
* reward: the episode's reward from verifiers' scoring (the task's ``@vf.reward``
  functions, weighted, plus what ``Env.run``/``finalize`` records); the sum over the
  episode's traces when an env runs several agents;
* done: when the verifiers episode ends (the harness exits, a ``@vf.stop`` fires, the
  env's ``run`` returns); an episode verifiers marks as failed ends as ``error``;
* metrics: each reward function's score (``reward/<name>``) and each ``@vf.metric``
  (``metric/<name>``), numbers only. verifiers awaits every reward and metric: one
  written as a plain ``def`` is refused when the env is built, naming it.

Tasks: the taskset's tasks, the seed picking one (``tasks[seed % len(tasks)]``; an
infinite taskset gives its first ``num_tasks``); with a prompt dataset each row (a dict
of the task's data fields, or a ``vf.Task``) is the task.

The harness is verifiers' own chat loop, run with this Python
(:mod:`~rollpipe.envs.adapters._verifiers_chat`) in verifiers' ``subprocess`` runtime:
no download, no container. Each episode starts one Python process for it (verifiers' own
runs do the same), which is most of an episode's cost on the tiny model. verifiers'
serving (its interception server, the taskset's shared tool servers) starts with an env
instance's first episode and stays up until the env is closed, as in ``vf-eval``.

Example (``taskset`` is a verifiers taskset id: an installed module exporting a
``vf.Taskset``, as ``vf-eval`` takes it)::

    register("add", lambda: VerifiersEnv(taskset="my_addition_taskset"))
    config = PipelineConfig(envs="add", group_size=4, batch_size=8)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import uuid
from collections.abc import Mapping
from typing import Any

from rollpipe.agent.records import EpisodeSpec
from rollpipe.frontdoor.agent import DEFAULT_AGENT_TIMEOUT_S, AgentEnv, AgentResult
from rollpipe.runtime import Runtime

__all__ = ["VerifiersEnv", "VerifiersEpisodeError"]

DEFAULT_NUM_TASKS = 1000
"""How many tasks of an infinite taskset the seed picks from."""

SERVING_STOP_S = 10.0
"""How long ``close`` waits for verifiers' servers (interception, tools) to stop."""


class VerifiersEpisodeError(RuntimeError):
    """verifiers marked the episode as failed (its errors are in the message)."""


def _import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            "VerifiersEnv needs verifiers: pip install 'rollpipe[verifiers]'"
        ) from exc
    return vf


def _local_agents(config: Any) -> Any:
    """``config`` with every agent seat on the local chat harness and runtime."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.harnesses.null import NullHarnessConfig
    from verifiers.v1.runtimes import SubprocessConfig

    from rollpipe.envs.adapters._verifiers_chat import HARNESS_ID

    harness = NullHarnessConfig(id=HARNESS_ID)
    seats = {
        name: spec.model_copy(update={"harness": harness, "runtime": SubprocessConfig()})
        for name, spec in agent_config_fields(config).items()
    }
    return config.model_copy(update=seats)


class VerifiersEnv(AgentEnv):
    """One verifiers env (a taskset, optionally a multi-agent ``vf.Env``) as an episode
    kind (see the module doc).

    Args:
        taskset: the verifiers taskset id (a module exporting one ``vf.Taskset`` in
            ``__all__``; hub ids work once the package is installed).
        env: a verifiers env id (a module exporting one ``vf.Env``); empty: the
            taskset's own ``vf.Env`` if it exports one, else ``vf.SingleAgentEnv``.
        taskset_config: fields of the taskset's config (``split``, ``num_tasks``, ...).
        num_tasks: how many tasks of an infinite taskset the seed picks from.
        model: the model name the harness sends (the front door serves any).
        max_turns: verifiers' cap on model turns per agent run (None: its default).
        timeout_s: the episode's time limit (``AgentEnv.timeout_s``).
    """

    def __init__(
        self,
        taskset: str,
        env: str = "",
        taskset_config: Mapping[str, Any] | None = None,
        *,
        num_tasks: int = DEFAULT_NUM_TASKS,
        model: str = "rollpipe",
        max_turns: int | None = None,
        timeout_s: float | None = DEFAULT_AGENT_TIMEOUT_S,
    ) -> None:
        vf = _import_verifiers()
        if not isinstance(taskset, str) or not taskset:
            raise ValueError(
                f"VerifiersEnv.taskset must be a verifiers taskset id, got {taskset!r}"
            )
        if not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"VerifiersEnv.num_tasks must be an int >= 1, got {num_tasks!r}")
        super().__init__(self._play, timeout_s=timeout_s)
        fields = {"id": taskset, **dict(taskset_config or {})}
        config = vf.env_config_type(taskset, env)(
            taskset=vf.taskset_config_type(taskset)(**fields), id=env
        )
        config = _local_agents(config)
        if max_turns is not None:
            config = config.model_copy(
                update={
                    name: getattr(config, name).model_copy(update={"max_turns": max_turns})
                    for name in _seats(config)
                }
            )
        self.vf_env = vf.environment_class(taskset, env)(config)
        self._serving = _Serving(self.vf_env)
        self.model = model
        source = self.vf_env.taskset
        self.tasks = list(source if source.bounded else source.take(num_tasks))
        if not self.tasks:
            raise ValueError(f"VerifiersEnv: taskset {taskset!r} has no tasks")
        _check_scoring_is_async(taskset, self.tasks)

    def task_for(self, spec: EpisodeSpec) -> Any:
        """The verifiers task of ``spec``: its dataset row, else ``tasks[seed % n]``."""
        if spec.row_index is None:
            return self.tasks[spec.seed % len(self.tasks)]
        row = spec.row
        if isinstance(row, Mapping):
            task_cls = type(self.vf_env.taskset).task_type()
            data = task_cls.data_type()(**dict(row))
            return task_cls(data, self.vf_env.taskset.config.task)
        if hasattr(row, "data") and hasattr(row, "score"):  # a vf.Task
            return row
        raise TypeError(
            f"VerifiersEnv: a dataset row must be a dict of the task's data fields or a "
            f"vf.Task, got {type(row).__name__}"
        )

    async def _play(self, client: Any, task: Any) -> AgentResult:
        """One verifiers episode of ``task`` against this episode's front-door session."""
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        key_var = f"ROLLPIPE_VERIFIERS_KEY_{uuid.uuid4().hex}"  # verifiers reads keys from
        os.environ[key_var] = client.api_key  # the environment; one variable a session
        try:
            endpoint = EvalClientConfig(base_url=str(client.base_url), api_key_var=key_var)
            ctx = ModelContext(model=self.model, client=endpoint)
            assert self.door is not None  # AgentEnv.run_episode opened it
            await self._serving.enter(self.door.engine.runtime)
            episode = await self.vf_env.run_episode(task, ctx)
        finally:
            os.environ.pop(key_var, None)
        if not episode.ok:
            errors = [e for trace in episode.traces for e in trace.errors] + list(episode.errors)
            detail = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
            raise VerifiersEpisodeError(f"verifiers episode failed: {detail}")
        return _result(episode.traces)

    def close(self) -> None:
        """Stop verifiers' serving (interception and tool servers) and the front door."""
        self._serving.close()
        super().close()


class _Serving:
    """verifiers' env-level serving (``vf.Env.serving()``: its interception server and
    the taskset's shared tool servers), entered on the runtime's loop by the first
    episode and held until :meth:`close`, as ``vf-eval`` holds it for a whole run.
    Episodes share only these servers: each ``run_episode`` has its own agents, trace,
    tool sessions and endpoint key."""

    def __init__(self, vf_env: Any) -> None:
        self.vf_env = vf_env
        self.stack: contextlib.AsyncExitStack | None = None
        self.runtime: Runtime | None = None
        self.lock: asyncio.Lock | None = None

    async def enter(self, runtime: Runtime) -> None:
        """Serving on ``runtime``'s loop (the running one), started once."""
        if self.stack is not None and self.runtime is runtime:
            return
        if self.runtime is not runtime:  # the first episode, or a pipeline on a new engine
            self.close()
            self.runtime, self.lock = runtime, asyncio.Lock()
        assert self.lock is not None
        async with self.lock:
            if self.stack is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.vf_env.serving())
                self.stack = stack

    def close(self) -> None:
        """Leave serving on its loop (from any thread; waits at most ``SERVING_STOP_S``)."""
        stack, runtime, self.stack, self.runtime = self.stack, self.runtime, None, None
        if stack is None or runtime is None or not runtime.alive:
            return
        if runtime.in_loop():
            runtime.loop.create_task(stack.aclose())
        else:
            with contextlib.suppress(Exception):  # a loop that is busy or closing
                runtime.call(stack.aclose(), SERVING_STOP_S)


def _check_scoring_is_async(taskset: str, tasks: list[Any]) -> None:
    """Refuse a ``@vf.reward`` / ``@vf.metric`` written as a plain ``def``: verifiers
    awaits them all together (``asyncio.gather``), so one would fail every episode at
    scoring with "An asyncio.Future, a coroutine or an awaitable is required"."""
    for task in {type(task): task for task in tasks}.values():  # one task of each type
        for kind in ("reward", "metric"):
            for fn in task.hooks(kind):
                if not inspect.iscoroutinefunction(inspect.unwrap(fn)):
                    raise TypeError(
                        f"VerifiersEnv: taskset {taskset!r}: {type(task).__name__}."
                        f"{fn.__name__} is a @vf.{kind} written as a plain `def`; verifiers "
                        f"awaits every {kind}: write it as `async def {fn.__name__}(...)`"
                    )


def _seats(config: Any) -> list[str]:
    from verifiers.v1.configs.agent import agent_config_fields

    return list(agent_config_fields(config))


def _result(traces: Any) -> AgentResult:
    """Reward, success and metrics of an episode's traces."""
    reward = 0.0
    metrics: dict[str, float] = {}
    for trace in traces:
        reward += float(trace.reward or 0.0)
        for name, value in trace.rewards.items():
            score = getattr(value, "score", value)
            if isinstance(score, (int, float)) and math.isfinite(score):
                metrics[f"reward/{name}"] = float(score)
        for name, value in trace.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[f"metric/{name}"] = float(value)
    return AgentResult(reward, success=reward > 0, metrics=metrics)
