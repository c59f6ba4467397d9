"""The image tests: the tiny Qwen2-VL on the real vLLM engine and transformers' processor.

They run only where torchvision imports (``nox -s vision``: the vision extra keeps it,
with rollpipe's guard for the CUDA wheel's missing ops); the main test session removes
torchvision, and there these modules are not collected at all (no skipped tests), as
``tests/compat`` does for verl. One in-process VLLMEngine on the tiny VLM serves the
whole session.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _torchvision_imports() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    import rollpipe.vision  # noqa: F401  (the guard, before torchvision)

    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


collect_ignore_glob = [] if _torchvision_imports() else ["test_*.py"]


@pytest.fixture(scope="session")
def vlm_path() -> Path:
    """The tiny random Qwen2-VL (built once into the user cache)."""
    from rollpipe.training.tiny_vlm import default_vlm_path

    return default_vlm_path()


@pytest.fixture(scope="session")
def processor(vlm_path: Path) -> Any:
    """Its transformers processor (Qwen2VLProcessor: tokenizer, image processor, template)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(vlm_path))


@pytest.fixture(scope="session")
def vlm_engine(vlm_path: Path) -> Iterator[Any]:
    """One in-process VLLMEngine on the tiny VLM for the whole session."""
    from rollpipe.engines.vllm import VLLMEngine

    engine = VLLMEngine(vlm_path, kv_cache_space_gib=0.5, max_model_len=2048, seed=0)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session")
def hf_vlm(vlm_path: Path) -> Any:
    """The tiny VLM in transformers (float32, eval), for forward passes on rows."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(vlm_path)).eval()
