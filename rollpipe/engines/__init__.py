"""Generation engines behind one token-in/token-out protocol (vLLM, transformers)."""

from __future__ import annotations

from rollpipe.engines.base import (
    BaseEngine,
    Engine,
    EngineClosedError,
    EngineError,
    Generation,
    PauseMode,
    SamplingParams,
)
from rollpipe.engines.hf import HFEngine
from rollpipe.engines.vllm import VLLMEngine

__all__ = [
    "BaseEngine",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "Generation",
    "HFEngine",
    "PauseMode",
    "SamplingParams",
    "VLLMEngine",
]
