"""Text environments: a protocol, a registry, FrozenLake and Sokoban, answer parsing."""

from __future__ import annotations

from rollpipe.envs.base import (
    AsyncTextEnv,
    EnvStateError,
    GridTextEnv,
    Info,
    StepResult,
    TextEnv,
    TextEnvConfig,
    is_async_env,
    is_blocking,
)
from rollpipe.envs.frozenlake import FrozenLake, FrozenLakeConfig, LakeMap
from rollpipe.envs.parsing import (
    DEFAULT_ANSWER_FORMAT,
    DEFAULT_ANSWER_PATTERN,
    parse_action,
    parse_answer,
)
from rollpipe.envs.registry import EnvRegistryError, available, config_keys, make, register
from rollpipe.envs.sokoban import Sokoban, SokobanConfig
from rollpipe.envs.sokoban_gen import Room, generate_room, solve

__all__ = [
    "DEFAULT_ANSWER_FORMAT",
    "DEFAULT_ANSWER_PATTERN",
    "AsyncTextEnv",
    "EnvRegistryError",
    "EnvStateError",
    "FrozenLake",
    "FrozenLakeConfig",
    "GridTextEnv",
    "Info",
    "LakeMap",
    "Room",
    "Sokoban",
    "SokobanConfig",
    "StepResult",
    "TextEnv",
    "TextEnvConfig",
    "available",
    "config_keys",
    "generate_room",
    "is_async_env",
    "is_blocking",
    "make",
    "parse_action",
    "parse_answer",
    "register",
    "solve",
]
