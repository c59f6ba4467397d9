"""Generation engines behind one token-in/token-out protocol (vLLM, transformers).

``protocol.py`` defines ``Engine`` and ``PauseMode``; ``records.py`` the request and result
records and the errors; ``inputs.py`` where prompts and weights are checked; ``base.py``
``BaseEngine``, which runs an engine on a runtime and drives one ``Backend``
(``backend.py``). ``vllm.py`` and ``hf.py`` are the two model engines, ``scripted.py`` one
that answers with a policy function; ``pool.py`` puts many
behind one (``routing.py`` picks the rank of each request); ``ray_engine.py`` hosts an
engine in a Ray actor and ``server.py`` talks to a running vLLM server.
"""

from __future__ import annotations

from rollpipe.engines.backend import Backend, EngineLink
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.hf import HFEngine
from rollpipe.engines.inputs import CheckedIds, PromptIds, check_prompt, named_tensors
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.protocol import PAUSE_MODES, Engine, PauseMode, WeightsLike
from rollpipe.engines.ray_engine import RayEngine, ray_pool
from rollpipe.engines.records import (
    FINISH_REASONS,
    EngineClosedError,
    EngineError,
    Generation,
    SamplingParams,
)
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.engines.server import ServerEngine, start_vllm_server
from rollpipe.engines.threads import resolve_cpu_threads, set_thread_torch_threads
from rollpipe.engines.vllm import VLLMEngine

__all__ = [
    "FINISH_REASONS",
    "PAUSE_MODES",
    "Backend",
    "BaseEngine",
    "CheckedIds",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EngineLink",
    "EnginePool",
    "Generation",
    "HFEngine",
    "PauseMode",
    "PromptIds",
    "RayEngine",
    "SamplingParams",
    "ScriptedEngine",
    "ServerEngine",
    "VLLMEngine",
    "WeightsLike",
    "check_prompt",
    "named_tensors",
    "ray_pool",
    "resolve_cpu_threads",
    "set_thread_torch_threads",
    "start_vllm_server",
]
