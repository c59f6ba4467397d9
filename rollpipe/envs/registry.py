"""Env registry: ``make("frozenlake", size=5)`` builds a registered env by name.

An env is named by a registered name or by an import path ``"package.module:Factory"``
(a class or a callable returning a ``TextEnv``): a registered name is known only in the
process that registered it, an import path resolves in any process (a Ray actor
included). An unknown name or config key fails with the list of valid ones (the keys come
from the factory's signature), so a typo in a YAML config fails at once instead of being
ignored; ``check_env`` also builds one env, so a bad value of its own fails then too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rollpipe._utils.import_path import NotAnImportPath, import_object
from rollpipe.agent.env_contract import runs_own_episode
from rollpipe.envs.base import AsyncTextEnv, ChatEnv, TextEnv

AnyEnv = TextEnv | AsyncTextEnv | ChatEnv

EnvFactory = Callable[..., Any]
"""Builds an env (a ``TextEnv``, an ``AsyncTextEnv`` or a ``ChatEnv``, duck-typed)."""

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


def is_import_path(name: object) -> bool:
    """Whether ``name`` names a factory by import path (``"package.module:Factory"``)."""
    return isinstance(name, str) and ":" in name


def _imported(path: str) -> EnvFactory:
    hint = "an import path is 'package.module:Factory' (a class or a callable returning an env)"
    try:
        obj = import_object(path)
    except NotAnImportPath:
        raise EnvRegistryError(f"env {path!r}: {hint}") from None
    except Exception as exc:  # not found, or the module failed to import
        raise EnvRegistryError(
            f"env {path!r}: cannot import it ({type(exc).__name__}: {exc}); {hint}, "
            "importable in this process"
        ) from exc
    if not callable(obj):
        raise EnvRegistryError(f"env {path!r} is {obj!r}, not callable; {hint}")
    return obj  # type: ignore[no-any-return]


def factory_of(name: str) -> EnvFactory:
    """The factory registered as ``name``, or imported from an import path; an unknown
    name lists the registered ones and says what to do."""
    if isinstance(name, str) and name in _REGISTRY:
        return _REGISTRY[name]
    if is_import_path(name):
        return _imported(name)
    raise EnvRegistryError(
        f"unknown env {name!r}; registered in this process: {available()}. Register it in "
        "this process (rollpipe.envs.register(name, factory)) before building the config, "
        "or name its factory by import path 'package.module:Factory', which resolves in "
        "any process (a Ray actor included)"
    )


def check_config(name: str, config: dict[str, Any]) -> None:
    """Raise EnvRegistryError naming every key of ``config`` env ``name`` does not take."""
    keys = config_keys(name)
    unknown = [] if keys is None else sorted(set(config) - set(keys))
    if unknown:
        raise EnvRegistryError(
            f"unknown config key(s) {unknown} for env {name!r}; valid keys: {sorted(keys or ())}"
        )


def make(name: str, **config: Any) -> AnyEnv:
    """Build env ``name`` (a registered name or an import path) with ``config``; unknown
    names/keys list the valid ones."""
    check_config(name, config)
    return factory_of(name)(**config)


def check_env(name: str, config: dict[str, Any], *, row: bool = False) -> None:
    """Raise EnvRegistryError unless env ``name`` can be built with ``config``: the name
    resolves, every key is one it takes, and one env built with it (then closed) accepts
    its values (``size=-3`` fails here, naming the env, not at the first episode). With
    ``row``, its ``reset`` must also take ``row=`` (a dataset's rows go there)."""
    check_config(name, config)
    try:
        env = factory_of(name)(**config)
    except Exception as exc:  # the env's own check of its config
        raise EnvRegistryError(
            f"env {name!r} rejects its config {config}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        if row and not takes_row(env):
            raise EnvRegistryError(
                f"env {name!r}: a dataset's rows reach the env as reset(seed, row=...), but "
                f"{type(env).__name__}.reset takes no 'row'; add the parameter, or use an env "
                "made for rows (rollpipe.envs.task.PromptTask)"
            )
    finally:
        close = getattr(env, "close", None)  # TextEnv.close is optional for user envs
        if callable(close):
            close()


def takes_row(env: Any) -> bool:
    """Whether ``env.reset`` accepts a ``row`` keyword (or any keyword); an episode kind
    (``AgentEnv``) takes its row from the spec."""
    if runs_own_episode(env):
        return True
    try:
        params = inspect.signature(env.reset).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the first reset tell
        return True
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "row" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in params
    )


def _verifiers_env(**config: Any) -> Any:
    """``VerifiersEnv(**config)``, imported when built: it is an ``AgentEnv``, and the front
    door imports the episode loop, which imports this registry."""
    from rollpipe.envs.adapters.verifiers import VerifiersEnv

    return VerifiersEnv(**config)


def _register_builtins() -> None:
    from rollpipe.envs.adapters.gem import GemEnv
    from rollpipe.envs.adapters.openenv import OpenEnvEnv
    from rollpipe.envs.adapters.reasoning_gym import ReasoningGymEnv
    from rollpipe.envs.adapters.textarena import TextArenaEnv
    from rollpipe.envs.calculator import calculator_env
    from rollpipe.envs.frozenlake import FrozenLake
    from rollpipe.envs.lookup import lookup_env
    from rollpipe.envs.sokoban import Sokoban
    from rollpipe.envs.task import PromptTask
    from rollpipe.envs.visual_envs import VisualFrozenLake, VisualSokoban

    register("frozenlake", FrozenLake)
    register("sokoban", Sokoban)
    register("frozenlake_visual", VisualFrozenLake)  # the grid as an image (content parts)
    register("sokoban_visual", VisualSokoban)
    register("task", PromptTask)
    register("calculator", calculator_env)
    register("lookup", lookup_env)
    register("gem", GemEnv)  # the ecosystems' adapters: each needs its extra when built
    register("reasoning_gym", ReasoningGymEnv)
    register("textarena", TextArenaEnv)
    register("openenv", OpenEnvEnv)
    register("verifiers", _verifiers_env)


_register_builtins()
