"""Images past one process: vLLM's multiprocess backend (its engine core in a spawned
process, where only the venv's .pth installs the torchvision guard) reports what the
in-process one does; a Ray actor and a vLLM server on the tiny VLM refuse images through
``supports``; and the guard only steps in where torchvision's ops did not load."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pictures import GREEDY, ids_of, random_image, render, user

from rollpipe.engines.records import EngineError
from rollpipe.vision import _torchvision

IMAGE = random_image(3)


@pytest.fixture(scope="module")
def prompt(processor: Any) -> list[int]:
    return ids_of(processor, render(processor, [user("Where is the goal?")]))


def test_the_multiprocess_backend_reports_what_the_inprocess_one_does(
    vlm_path: Path, vlm_engine: Any, prompt: list[int]
) -> None:
    from rollpipe.engines.vllm import VLLMEngine

    want = asyncio.run(vlm_engine.generate(prompt, GREEDY, images=[IMAGE]))
    with VLLMEngine(vlm_path, kv_cache_space_gib=0.25, multiprocess=True) as engine:
        assert engine.supports("images")
        got = asyncio.run(engine.generate(prompt, GREEDY, images=[IMAGE]))
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.token_ids == want.token_ids


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_ray_actor_refuses_images(cluster: None, vlm_path: Path, prompt: list[int]) -> None:
    """The hosted HFEngine takes images (the actor's process imports torchvision through
    the .pth guard), but RayEngine does not carry them: supports is False and a request
    with images raises EngineError naming what to use; text goes through."""
    from rollpipe.engines.hf import HFEngine
    from rollpipe.engines.ray_engine import RayEngine

    with RayEngine(functools.partial(HFEngine, str(vlm_path)), num_cpus=1) as engine:
        assert not engine.supports("images")
        with pytest.raises(EngineError, match=r"^RayEngine.generate\(images=...\): .*VLLMEngine"):
            asyncio.run(engine.generate(prompt, GREEDY, images=[IMAGE]))
        assert engine.generate_batch([prompt[:5]], GREEDY)[0].num_tokens == GREEDY.max_tokens


def test_a_vllm_server_refuses_images(vlm_path: Path, prompt: list[int]) -> None:
    """A real vLLM server on the tiny VLM (its process imports torchvision through the
    .pth guard): ServerEngine does not carry images."""
    from rollpipe.engines.server import ServerEngine, start_vllm_server

    server = start_vllm_server(vlm_path, kv_cache_space_gib=0.25, timeout_s=300)
    try:
        with ServerEngine(server.url) as engine:
            assert not engine.supports("images")
            with pytest.raises(EngineError, match=r"^ServerEngine.generate\(images=...\)"):
                asyncio.run(engine.generate(prompt, GREEDY, images=[IMAGE]))
            assert engine.generate_batch([prompt[:5]], GREEDY)[0].num_tokens > 0
    finally:
        server.close()


def test_the_guard_skips_the_registrations_only_where_the_ops_did_not_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Here (a CUDA torchvision beside the CPU torch) the two registration modules were
    stand-ins; without the guard torchvision does not import; where torchvision says its
    ops loaded, the guard answers None (the real modules register)."""
    import torchvision

    assert torchvision.extension._has_ops() is False
    assert set(_torchvision.skipped()) == set(_torchvision.REGISTRATIONS)
    assert (Path(sysconfig.get_paths()["purelib"]) / _torchvision.PTH_NAME).is_file()
    unguarded = (
        "import sys; sys.meta_path = [f for f in sys.meta_path "
        "if not getattr(f, 'rollpipe_torchvision_guard', False)]; import torchvision"
    )
    run = subprocess.run([sys.executable, "-c", unguarded], capture_output=True, text=True)
    assert run.returncode != 0 and "torchvision::nms does not exist" in run.stderr
    finder = _torchvision._RegistrationFinder()
    assert finder.find_spec("torchvision._meta_registrations") is not None
    assert finder.find_spec("torchvision.ops") is None  # only the two registrations
    loaded = ModuleType("torchvision.extension")
    loaded._has_ops = lambda: True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision.extension", loaded)
    assert finder.find_spec("torchvision._meta_registrations") is None
