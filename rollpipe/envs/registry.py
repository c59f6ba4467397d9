"""Env registry: ``make("frozenlake", size=5)`` builds a registered env by name.

An unknown name or config key fails with the list of valid ones (the keys come from the
factory's signature), so a typo in a YAML config fails at once instead of being ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rollpipe.envs.base import AsyncTextEnv, TextEnv

EnvFactory = Callable[..., TextEnv | AsyncTextEnv]

_REGISTRY: dict[str, EnvFactory] = {}


class EnvRegistryError(ValueError):
    """Unknown env name, unknown config key, or a clashing registration."""


def register(name: str, factory: EnvFactory, *, overwrite: bool = False) -> None:
    """Register ``factory`` (an env class or function taking keyword config) as ``name``."""
    if not isinstance(name, str) or not name:
        raise EnvRegistryError(f"env name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise EnvRegistryError(f"factory for env {name!r} must be callable, got {factory!r}")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not factory:
        raise EnvRegistryError(
            f"env {name!r} is already registered to {_REGISTRY[name]!r}; pass overwrite=True"
        )
    _REGISTRY[name] = factory


def available() -> list[str]:
    """Registered env names, sorted."""
    return sorted(_REGISTRY)


def config_keys(name: str) -> list[str] | None:
    """The keyword config keys env ``name`` accepts (None if it takes ``**kwargs``)."""
    factory = factory_of(name)
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds]


def factory_of(name: str) -> EnvFactory:
    """The factory registered as ``name``; an unknown name lists the registered ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise EnvRegistryError(
            f"unknown env {name!r}; available: {available()} (register(name, factory) adds one)"
        ) from None


def check_config(name: str, config: dict[str, Any]) -> None:
    """Raise EnvRegistryError naming every key of ``config`` env ``name`` does not take."""
    keys = config_keys(name)
    unknown = [] if keys is None else sorted(set(config) - set(keys))
    if unknown:
        raise EnvRegistryError(
            f"unknown config key(s) {unknown} for env {name!r}; valid keys: {sorted(keys or ())}"
        )


def make(name: str, **config: Any) -> TextEnv | AsyncTextEnv:
    """Build env ``name`` with ``config``; unknown names/keys list the valid ones."""
    check_config(name, config)
    return factory_of(name)(**config)


def _register_builtins() -> None:
    from rollpipe.envs.frozenlake import FrozenLake
    from rollpipe.envs.sokoban import Sokoban

    register("frozenlake", FrozenLake)
    register("sokoban", Sokoban)


_register_builtins()
