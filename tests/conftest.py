"""Shared session fixtures: the tiny model, its tokenizer and one engine of each kind.

Engines are expensive to start, so each kind is created once per test session and
shared. A test that pauses an engine need not clean up: an autouse fixture resumes
every shared engine after each test.

The TRL tests run only where TRL is installed (``nox -s trl``); elsewhere they are not
collected (no skipped tests), as ``tests/compat`` and ``tests/ecosystems`` do.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpipe.training.tiny_model import default_model_path

_SHARED_ENGINES: list[Any] = []

collect_ignore = (
    [] if importlib.util.find_spec("trl") else ["test_trl_rollout.py", "test_trl_env.py"]
)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The built-in tiny Qwen2 model (built once into the user cache)."""
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path: Path) -> Any:
    """The tiny model's HF tokenizer (ChatML template, eos <|im_end|>, pad <|endoftext|>)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def _shared(engine: Any) -> Iterator[Any]:
    """Yield ``engine`` as a session's shared engine (resumed after each test), then
    close it."""
    _SHARED_ENGINES.append(engine)
    try:
        yield engine
    finally:
        _SHARED_ENGINES.remove(engine)
        engine.close()


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_path: Path) -> Iterator[Any]:
    """One in-process VLLMEngine for the whole session (1 GiB KV cache, eager)."""
    from rollpipe.engines.vllm import VLLMEngine  # vLLM is a test dependency: never skip

    yield from _shared(
        VLLMEngine(tiny_model_path, kv_cache_space_gib=1, max_model_len=2048, seed=0)
    )


@pytest.fixture(scope="session")
def tools_vllm_engine() -> Iterator[Any]:
    """One in-process VLLMEngine on the tiny model's tool-calling variant (hermes-style
    template and marker tokens), shared by the front-door tests."""
    from rollpipe.engines.vllm import VLLMEngine

    path = default_model_path(tools=True)
    yield from _shared(VLLMEngine(path, kv_cache_space_gib=1, max_model_len=2048, seed=0))


@pytest.fixture(scope="session")
def tool_warm_start_engine() -> Iterator[Any]:
    """One in-process VLLMEngine on the shipped lookup warm start (it calls the lookup
    tool), shared by the tests of the examples that show a working tool agent."""
    from rollpipe.engines.vllm import VLLMEngine
    from rollpipe.training.tool_warm_start import LOOKUP_RECIPE, tool_warm_start_model_path

    path = tool_warm_start_model_path(LOOKUP_RECIPE)
    yield from _shared(VLLMEngine(path, kv_cache_space_gib=0.5, max_model_len=1024, seed=0))


@pytest.fixture(scope="session")
def hf_engine(tiny_model_path: Path) -> Iterator[Any]:
    """One HFEngine (transformers generate, micro-batched) for the whole session."""
    from rollpipe.engines.hf import HFEngine

    yield from _shared(HFEngine(tiny_model_path))


@pytest.fixture(autouse=True)
def _resume_shared_engines() -> Iterator[None]:
    """Leave every shared engine unpaused after each test."""
    yield
    for engine in list(_SHARED_ENGINES):
        if not engine.closed and engine.is_paused:
            engine.resume()
