"""rollpipe: rollout-data pipelines for LLM reinforcement learning, built on torchdata.

The public names are re-exported here and imported lazily, so ``import rollpipe`` stays
cheap and does not start (or need) vLLM until an engine is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "DataProto": "rollpipe.proto",
    "pad_to_divisor": "rollpipe.proto",
    "unpad": "rollpipe.proto",
    "EpisodeSpec": "rollpipe.trajectory",
    "Turn": "rollpipe.trajectory",
    "Trajectory": "rollpipe.trajectory",
    "Group": "rollpipe.trajectory",
    "ChatFormat": "rollpipe.chat",
    "run_episode": "rollpipe.episode",
    "trajectory_rows": "rollpipe.formulation",
    "step_rows": "rollpipe.formulation",
    "SamplingParams": "rollpipe.engines.base",
    "Generation": "rollpipe.engines.base",
    "EngineError": "rollpipe.engines.base",
    "EngineClosedError": "rollpipe.engines.base",
    "VLLMEngine": "rollpipe.engines.vllm",
    "HFEngine": "rollpipe.engines.hf",
    "build_tiny_model": "rollpipe.models",
    "default_model_path": "rollpipe.models",
    "RolloutControl": "rollpipe.nodes.control",
    "EnvChoice": "rollpipe.nodes.episodes",
    "EpisodeSource": "rollpipe.nodes.episodes",
    "Rollout": "rollpipe.nodes.rollout",
    "GroupAssembler": "rollpipe.nodes.groups",
    "Batch": "rollpipe.nodes.batch",
    "TrajectoryBatch": "rollpipe.nodes.batch",
    "Collate": "rollpipe.nodes.collate",
    "Pausable": "rollpipe.nodes.pausable",
    "PauseController": "rollpipe.nodes.pausable",
    "PipelineConfig": "rollpipe.pipeline",
    "PipelineNodes": "rollpipe.pipeline",
    "RolloutPipeline": "rollpipe.pipeline",
    "build_nodes": "rollpipe.pipeline",
    "RolloutBuffer": "rollpipe.buffer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from rollpipe.buffer import RolloutBuffer
    from rollpipe.chat import ChatFormat
    from rollpipe.engines.base import (
        EngineClosedError,
        EngineError,
        Generation,
        SamplingParams,
    )
    from rollpipe.engines.hf import HFEngine
    from rollpipe.engines.vllm import VLLMEngine
    from rollpipe.episode import run_episode
    from rollpipe.formulation import step_rows, trajectory_rows
    from rollpipe.models import build_tiny_model, default_model_path
    from rollpipe.nodes.batch import Batch, TrajectoryBatch
    from rollpipe.nodes.collate import Collate
    from rollpipe.nodes.control import RolloutControl
    from rollpipe.nodes.episodes import EnvChoice, EpisodeSource
    from rollpipe.nodes.groups import GroupAssembler
    from rollpipe.nodes.pausable import Pausable, PauseController
    from rollpipe.nodes.rollout import Rollout
    from rollpipe.pipeline import PipelineConfig, PipelineNodes, RolloutPipeline, build_nodes
    from rollpipe.proto import DataProto, pad_to_divisor, unpad
    from rollpipe.trajectory import EpisodeSpec, Group, Trajectory, Turn


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
