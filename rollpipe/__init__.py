"""rollpipe: rollout-data pipelines for LLM reinforcement learning, built on torchdata.

The public names are re-exported here and imported lazily, so ``import rollpipe`` stays
cheap and does not start (or need) vLLM until an engine is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "DataProto": "rollpipe.data.proto",
    "pad_to_divisor": "rollpipe.data.proto.divisor",
    "unpad": "rollpipe.data.proto.divisor",
    "EpisodeSpec": "rollpipe.agent.records",
    "Turn": "rollpipe.agent.records",
    "Trajectory": "rollpipe.agent.records",
    "Group": "rollpipe.agent.records",
    "ChatFormat": "rollpipe.agent.chat",
    "AssistantAction": "rollpipe.agent.actions",
    "ToolCall": "rollpipe.agent.actions",
    "ToolSet": "rollpipe.agent.tools",
    "ResponseParser": "rollpipe.agent.parsers",
    "ToolEnv": "rollpipe.envs.tool_env",
    "calculator_env": "rollpipe.envs.calculator",
    "PromptTask": "rollpipe.envs.task",
    "DatasetSettings": "rollpipe.nodes.dataset",
    "ScriptedEngine": "rollpipe.engines.scripted",
    "AgentEnv": "rollpipe.frontdoor.agent",
    "AgentResult": "rollpipe.frontdoor.agent",
    "FrontDoor": "rollpipe.frontdoor.server",
    "TRLEnv": "rollpipe.integrations.trl_env",
    "pipeline_rollout": "rollpipe.integrations.trl",
    "grpo_trainer_kwargs": "rollpipe.integrations.trl",
    "run_episode": "rollpipe.agent.episode",
    "trajectory_rows": "rollpipe.data.rows",
    "to_roll": "rollpipe.data.roll_layout",
    "to_verl": "rollpipe.data.verl_layout",
    "step_rows": "rollpipe.data.rows",
    "SamplingParams": "rollpipe.engines.records",
    "Generation": "rollpipe.engines.records",
    "EngineError": "rollpipe.engines.records",
    "EngineClosedError": "rollpipe.engines.records",
    "VLLMEngine": "rollpipe.engines.vllm",
    "HFEngine": "rollpipe.engines.hf",
    "EnginePool": "rollpipe.engines.pool",
    "Correction": "rollpipe.corrections.correction",
    "build_tiny_model": "rollpipe.training.tiny_model",
    "default_model_path": "rollpipe.training.tiny_model",
    "PipelineSignals": "rollpipe.nodes.signals",
    "UpstreamSignals": "rollpipe.nodes.signals",  # old name of PipelineSignals
    "EnvChoice": "rollpipe.nodes.episode_source",
    "EpisodeSource": "rollpipe.nodes.episode_source",
    "EpisodeRunner": "rollpipe.nodes.rollout",
    "Rollout": "rollpipe.nodes.rollout",  # old name of EpisodeRunner
    "GroupAssembler": "rollpipe.nodes.groups",
    "Batch": "rollpipe.nodes.batch",
    "TrajectoryBatch": "rollpipe.nodes.batch",
    "Collate": "rollpipe.nodes.collate",
    "Pausable": "rollpipe.nodes.pausable",
    "Suspension": "rollpipe.nodes.suspension",
    "PipelineConfig": "rollpipe.config",
    "SourceSettings": "rollpipe.nodes.episode_source",
    "EpisodeSettings": "rollpipe.agent.episode",
    "RunnerSettings": "rollpipe.nodes.rollout",
    "RolloutSettings": "rollpipe.nodes.rollout",  # old name of RunnerSettings
    "GroupSettings": "rollpipe.nodes.groups",
    "CollateSettings": "rollpipe.nodes.collate",
    "PipelineNodes": "rollpipe.pipeline",
    "RolloutPipeline": "rollpipe.pipeline",
    "build_nodes": "rollpipe.pipeline",
    "CheckpointError": "rollpipe.checkpoint",
    "save_checkpoint": "rollpipe.checkpoint",
    "load_checkpoint": "rollpipe.checkpoint",
    "latest_checkpoint": "rollpipe.checkpoint",
    "save_step_checkpoint": "rollpipe.checkpoint",
    "RolloutBuffer": "rollpipe.training.ppo_buffer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from rollpipe.agent.actions import AssistantAction, ToolCall
    from rollpipe.agent.chat import ChatFormat
    from rollpipe.agent.episode import EpisodeSettings, run_episode
    from rollpipe.agent.parsers import ResponseParser
    from rollpipe.agent.records import EpisodeSpec, Group, Trajectory, Turn
    from rollpipe.agent.tools import ToolSet
    from rollpipe.checkpoint import (
        CheckpointError,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
        save_step_checkpoint,
    )
    from rollpipe.config import PipelineConfig
    from rollpipe.corrections.correction import Correction
    from rollpipe.data.proto import DataProto
    from rollpipe.data.proto.divisor import pad_to_divisor, unpad
    from rollpipe.data.roll_layout import to_roll
    from rollpipe.data.rows import step_rows, trajectory_rows
    from rollpipe.data.verl_layout import to_verl
    from rollpipe.engines.hf import HFEngine
    from rollpipe.engines.pool import EnginePool
    from rollpipe.engines.records import EngineClosedError, EngineError, Generation, SamplingParams
    from rollpipe.engines.scripted import ScriptedEngine
    from rollpipe.engines.vllm import VLLMEngine
    from rollpipe.envs.calculator import calculator_env
    from rollpipe.envs.task import PromptTask
    from rollpipe.envs.tool_env import ToolEnv
    from rollpipe.frontdoor.agent import AgentEnv, AgentResult
    from rollpipe.frontdoor.server import FrontDoor
    from rollpipe.integrations.trl import grpo_trainer_kwargs, pipeline_rollout
    from rollpipe.integrations.trl_env import TRLEnv
    from rollpipe.nodes.batch import Batch, TrajectoryBatch
    from rollpipe.nodes.collate import Collate, CollateSettings
    from rollpipe.nodes.dataset import DatasetSettings
    from rollpipe.nodes.episode_source import EnvChoice, EpisodeSource, SourceSettings
    from rollpipe.nodes.groups import GroupAssembler, GroupSettings
    from rollpipe.nodes.pausable import Pausable
    from rollpipe.nodes.rollout import EpisodeRunner, Rollout, RolloutSettings, RunnerSettings
    from rollpipe.nodes.signals import PipelineSignals, UpstreamSignals
    from rollpipe.nodes.suspension import Suspension
    from rollpipe.pipeline import PipelineNodes, RolloutPipeline, build_nodes
    from rollpipe.training.ppo_buffer import RolloutBuffer
    from rollpipe.training.tiny_model import build_tiny_model, default_model_path


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollpipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
