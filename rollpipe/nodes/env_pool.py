"""EnvPool: environment instances reused across episodes, keyed by env name and config.

Building an env can be costly (a Sokoban room generator, a browser); an episode takes a
free instance of its kind, or builds one, and gives it back when it ends. Each instance
keeps the id it was built with, which rows report as ``env_ids``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from rollpipe.agent.env_contract import EnvForSpec
from rollpipe.agent.records import EpisodeSpec
from rollpipe.envs import make as make_env

__all__ = ["EnvForSpec", "EnvPool", "registry_env"]


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
