"""Text environments: a protocol, a registry, FrozenLake and Sokoban (also seen as images),
answer parsing, content parts."""

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
from rollpipe.envs.content import ContentError, image_parts, text_of_parts
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
from rollpipe.envs.visual_envs import VisualFrozenLake, VisualSokoban

__all__ = [
    "DEFAULT_ANSWER_FORMAT",
    "DEFAULT_ANSWER_PATTERN",
    "AsyncTextEnv",
    "ContentError",
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
    "VisualFrozenLake",
    "VisualSokoban",
    "available",
    "config_keys",
    "generate_room",
    "image_parts",
    "is_async_env",
    "is_blocking",
    "make",
    "parse_action",
    "parse_answer",
    "register",
    "solve",
    "text_of_parts",
]
