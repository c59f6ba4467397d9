"""EnvPool: environment instances reused across episodes, keyed by env name and config.

Building an env can be costly (a Sokoban room generator, a browser); an episode takes a
free instance of its kind, or builds one, and gives it back when it ends. Each instance
keeps the id it was built with, which rows report as ``env_ids``. :func:`run_spec` runs
one spec's episode on a pooled env: the same on the driver and in an episode worker.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.env_contract import EnvForSpec, runs_own_episode
from rollpipe.agent.env_threads import EnvLease, EnvThreads
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.engines.protocol import Engine
from rollpipe.envs import make as make_env

__all__ = ["EnvForSpec", "EnvPool", "registry_env", "run_spec"]


def registry_env(spec: EpisodeSpec) -> Any:
    """The env named by the spec, from the registry, with the spec's config."""
    return make_env(spec.env_name, **dict(spec.env_config))


class EnvPool:
    """Free env instances per (env name, config); ``close()`` closes every one built."""

    def __init__(self, build: EnvForSpec | None = None) -> None:
        self.build = build or registry_env
        self._free: dict[Hashable, list[tuple[int, Any]]] = {}
        self._all: list[Any] = []

    def acquire(self, spec: EpisodeSpec) -> tuple[int, Any]:
        """A free env for ``spec`` (built if none is free) and its id."""
        free = self._free.setdefault((spec.env_name, spec.env_config), [])
        if free:
            return free.pop()
        env = self.build(spec)
        self._all.append(env)
        return len(self._all) - 1, env

    def release(self, spec: EpisodeSpec, env_id: int, env: Any) -> None:
        """Give an env back for the next episode of its kind."""
        self._free.setdefault((spec.env_name, spec.env_config), []).append((env_id, env))

    def close(self) -> None:
        """Close every env built (those with a ``close`` method); the first error is raised
        after all were tried."""
        envs, self._all, self._free = self._all, [], {}
        first: Exception | None = None
        for env in envs:
            close = getattr(env, "close", None)  # TextEnv.close is optional for user envs
            try:
                if close is not None:
                    close()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


async def run_spec(
    spec: EpisodeSpec,
    envs: EnvPool,
    engine: Engine,
    chat: ChatFormat,
    settings: EpisodeSettings,
    *,
    admit: Callable[[], Awaitable[None]] | None,
    env_threads: EnvThreads,
    env_calls_on_threads: bool,
    env_id_offset: int = 0,
) -> Trajectory:
    """``spec``'s episode on a pooled env: an episode kind (``AgentEnv``) runs its own,
    a text env runs ``run_episode``; the env goes back to ``envs`` once no call of it runs.
    ``env_id_offset`` is added to the id rows report (an episode worker's slot)."""
    local_id, env = envs.acquire(spec)
    env_id = env_id_offset + local_id
    lease = EnvLease(functools.partial(envs.release, spec, local_id, env))
    try:
        if runs_own_episode(env):  # an episode kind (AgentEnv), not an env to step
            return await env.run_episode(  # type: ignore[no-any-return]
                spec, engine, chat, settings, admit=admit, env_id=env_id
            )
        return await run_episode(
            spec,
            env,
            engine,
            chat,
            settings,
            env_id=env_id,
            admit=admit,
            env_threads=env_threads,
            env_lease=lease,  # an env is reused only once no call of it runs
            env_calls_on_threads=env_calls_on_threads,
        )
    finally:
        lease.end()
