"""AgentEnv: the agent episode kind — your ``openai``-client agent, run as an episode.

You write ``async def agent(client, task) -> reward`` against an ``openai.AsyncOpenAI``
client; rollpipe hands it one pointed at a :class:`~rollpipe.frontdoor.server.FrontDoor`
on the pipeline's engine, with a key unique to the episode. Every call it makes is
recorded as exact token ids (:class:`~rollpipe.frontdoor.session.AgentSession`), and the
episode ends as a :class:`~rollpipe.agent.records.Trajectory` like any other: groups,
batches and rows work unchanged. The agent may return a float (the reward) or an
:class:`AgentResult` (reward, success, metrics).

Outcomes: the agent returns -> ``"terminated"``; it raises, or does not return within
``timeout_s`` (its calls in flight are cancelled), or an engine request times out ->
``"error"`` with the reason; an engine error propagates as in ``run_episode``.

The agent runs on the engine's event loop: it must not block (run blocking work with
``await asyncio.to_thread(...)``).

Examples:
    >>> async def agent(client, task):
    ...     reply = await client.chat.completions.create(
    ...         model="rollpipe", messages=[{"role": "user", "content": task}])
    ...     return float("4" in (reply.choices[0].message.content or ""))
    >>> env = AgentEnv(agent, task=lambda seed: "What is 2 + 2?")
    >>> # register("two-plus-two", lambda: AgentEnv(agent, ...)); then envs="two-plus-two"
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import EngineError
from rollpipe.frontdoor.doors import acquire_door, release_door
from rollpipe.frontdoor.server import FrontDoor

__all__ = ["AgentEnv", "AgentResult", "AgentTimeoutError"]

DEFAULT_AGENT_TIMEOUT_S = 600.0

Agent = Callable[[Any, Any], Awaitable[Any]]


class AgentTimeoutError(TimeoutError):
    """The agent did not return within ``AgentEnv.timeout_s``."""


@attrs.frozen
class AgentResult:
    """What an agent may return instead of a bare reward.

    Examples:
        >>> AgentResult(1, success=True, metrics={"agent/steps": 2.0})
        AgentResult(reward=1.0, success=True, metrics={'agent/steps': 2.0})
    """

    reward: float = attrs.field(converter=float)
    success: bool = attrs.field(default=False, converter=bool)
    metrics: Mapping[str, float] = attrs.field(factory=dict)


def _result(value: Any) -> AgentResult:
    if isinstance(value, AgentResult):
        result = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = AgentResult(float(value))
    else:
        raise TypeError(
            f"the agent returned {type(value).__name__} {value!r}; return a float reward "
            "or an AgentResult(reward, success, metrics)"
        )
    if not math.isfinite(result.reward):
        raise ValueError(f"the agent returned reward {result.reward}; return a finite number")
    return result


class AgentEnv:
    """An episode kind that runs ``agent(client, task)`` (see the module doc): an
    :class:`~rollpipe.agent.env_contract.EpisodeKind`, with no ``reset`` / ``step``.

    Args:
        agent: ``async def agent(client, task) -> float | AgentResult``.
        task: ``task(seed) -> anything`` the agent gets (group members share the seed).
            None: the dataset row of the spec, else the seed.
        timeout_s: the agent's time limit per episode (None: no limit).
        client_options: extra keywords for ``openai.AsyncOpenAI`` (``timeout``, ...).
        keep_tools: a call without ``tools`` (the usual final "answer" call) is rendered
            with the tools the agent sent last, so the trajectory stays one row; False:
            rendered without tools, which starts a second row when the template puts
            the tools in the prompt (:class:`~rollpipe.frontdoor.session.AgentSession`).

    The EpisodeRunner runs it through :meth:`run_episode` instead of the text-env loop. The
    AgentEnvs of one pipeline share one front door: it starts with the first episode
    and stops when the last of them is closed.

    Examples:
        One episode on the engine's loop, as the EpisodeRunner runs each spec:

        >>> async def agent(client, task):
        ...     messages = [{"role": "user", "content": task}]
        ...     reply = await client.chat.completions.create(
        ...         model="rollpipe", messages=messages, max_tokens=8)
        ...     return AgentResult(1.0, success=reply.choices[0].message.role == "assistant")
        >>> env = AgentEnv(agent, task=lambda seed: f"What is {seed} + 3?")
        >>> spec, chat, settings = EpisodeSpec(0, 0, 2), ChatFormat(tokenizer), EpisodeSettings()
        >>> traj = engine.runtime.call(env.run_episode(spec, engine, chat, settings))
        >>> env.close()
        >>> traj.end_reason, traj.num_turns, traj.score, traj.success
        ('terminated', 1, 1.0, True)
        >>> "What is 2 + 3?" in tokenizer.decode(traj.turns[0].prompt_ids)
        True
    """

    def __init__(
        self,
        agent: Agent,
        task: Callable[[int], Any] | None = None,
        *,
        timeout_s: float | None = DEFAULT_AGENT_TIMEOUT_S,
        client_options: Mapping[str, Any] | None = None,
        keep_tools: bool = True,
    ) -> None:
        if not callable(agent):
            raise ValueError(f"AgentEnv.agent must be an async function, got {agent!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"AgentEnv.timeout_s must be > 0 or None, got {timeout_s!r}")
        self.agent, self.task, self.timeout_s = agent, task, timeout_s
        self.client_options = dict(client_options or {})
        if not isinstance(keep_tools, bool):
            raise ValueError(f"AgentEnv.keep_tools must be True or False, got {keep_tools!r}")
        self.keep_tools = keep_tools
        self.door: FrontDoor | None = None

    def task_for(self, spec: EpisodeSpec) -> Any:
        """The task of ``spec``'s episode."""
        if self.task is not None:
            return self.task(spec.seed)
        return spec.row if spec.row_index is not None else spec.seed

    async def run_episode(
        self,
        spec: EpisodeSpec,
        engine: Engine,
        chat: ChatFormat,
        settings: EpisodeSettings,
        *,
        admit: Callable[[], Awaitable[None]] | None = None,
        env_id: int = 0,
    ) -> Trajectory:
        """Run one episode of the agent on ``engine`` (on its runtime loop)."""
        import openai

        door = await self._door(engine, chat, settings)
        session = door.open_session(spec, admit, keep_tools=self.keep_tools)
        options = {"max_retries": 0, **self.client_options}
        if "http_client" not in options:  # plain http to this process: loading the CA
            # bundle for TLS would cost ~20 ms of the loop per episode, for nothing
            options["http_client"] = openai.DefaultAsyncHttpxClient(verify=False)
        client = openai.AsyncOpenAI(base_url=door.url, api_key=session.key, **options)
        error: BaseException | None = None
        result = AgentResult(0.0)
        try:
            async with asyncio.timeout(self.timeout_s) as limit:
                result = _result(await self.agent(client, self.task_for(spec)))
        except Exception as exc:  # the agent's own bug, or a refused request it raised on
            error = exc
            if isinstance(exc, TimeoutError) and limit.expired():
                error = AgentTimeoutError(f"the agent did not return within {self.timeout_s} s")
        finally:
            if session.key in door.sessions:
                door._end(session.key)
            await client.close()
        if isinstance(session.failure, EngineError):
            raise session.failure  # as run_episode: engine errors propagate
        if session.failure is not None:  # a request over generation_timeout_s
            error = session.failure
        return session.trajectory(
            result.reward,
            success=result.success,
            error=error,
            metrics=result.metrics,
            env_id=env_id,
            error_call="agent",
        )

    async def _door(self, engine: Engine, chat: ChatFormat, settings: EpisodeSettings) -> FrontDoor:
        """The pipeline's shared door (:mod:`rollpipe.frontdoor.doors`)."""
        door = self.door
        if door is None or door.engine is not engine or door.chat is not chat or door.closed:
            if door is not None:
                release_door(self, door)
            self.door = door = await acquire_door(self, engine, chat, settings)
        return door

    def close(self) -> None:
        """Stop the front door (from any thread; the EpisodeRunner calls it when it closes)."""
        door, self.door = self.door, None
        if door is not None:
            release_door(self, door)
