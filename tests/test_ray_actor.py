"""The seed's RolloutScheduler pattern, as written, with the pipeline in a Ray actor.

ROLL drives its scheduler actor as ``ray.get(scheduler.suspend.remote())`` → model update
→ ``ray.get(scheduler.get_batch.remote(data=DataProto(meta_info={"global_step": step}),
batch_size=N))`` → ``shutdown``. Here the actor is ``RolloutPipeline`` itself (threaded,
``max_concurrency=4``: each call may run on another thread) or ``AsyncRolloutActor``; the
engine is built inside the actor from a factory, the tokenizer from a path. Each batch is
on-policy: its tokens carry the version the update returned (a perturbed model each step).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollpipe.data.proto import DataProto
from rollpipe.engines.vllm import VLLMEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline
from rollpipe.remote import AsyncRolloutActor

ray = pytest.importorskip("ray")  # the dev extra installs it: CI always runs these

CONFIG = PipelineConfig(
    group_size=2,
    batch_size=4,
    max_turns=2,
    max_length=256,
    concurrency=4,
    seed=3,
    sampling={"max_tokens": 8},
)
STEPS = 2
BATCH = 4
CALL_S = 300  # a deadline only a hang reaches


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=200 << 20,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def make_engine(tiny_model_path: Path) -> functools.partial[VLLMEngine]:
    return functools.partial(VLLMEngine, str(tiny_model_path), kv_cache_space_gib=0.25)


def perturbed(path: Path, step: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights plus seeded noise: each step's update is a new policy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    noise = torch.Generator().manual_seed(step)
    return {
        name: (value + 0.01 * torch.randn(value.shape, generator=noise)).detach()
        for name, value in model.state_dict().items()
    }


def response_versions(batch: DataProto) -> set[int]:
    mask = batch.batch["response_mask"].bool()
    return set(batch.batch["policy_versions"][mask].unique().tolist())


def seed_loop(scheduler: Any, path: Path) -> list[int]:
    """The seed's calls, exactly; returns each step's policy version."""
    versions = []
    for step in range(STEPS):
        ray.get(scheduler.suspend.remote(), timeout=CALL_S)
        version = ray.get(scheduler.update_weights.remote(perturbed(path, step)), timeout=CALL_S)
        batch = ray.get(
            scheduler.get_batch.remote(
                data=DataProto(meta_info={"global_step": step}), batch_size=BATCH
            ),
            timeout=CALL_S,
        )
        assert batch is not None and len(batch) == BATCH
        assert batch.meta_info["global_step"] == step
        assert response_versions(batch) == {version}  # on-policy: the weights just loaded
        versions.append(version)
    ray.get(scheduler.shutdown.remote(), timeout=CALL_S)
    return versions


def test_threaded_actor_runs_the_seed_loop(cluster: None, make_engine: Any, tiny_model_path: Path):
    actor = ray.remote(RolloutPipeline).options(max_concurrency=4, num_cpus=1)
    scheduler = actor.remote(CONFIG, make_engine, str(tiny_model_path))
    try:
        assert seed_loop(scheduler, tiny_model_path) == [1, 2]
    finally:
        ray.kill(scheduler)


def test_async_actor_runs_the_seed_loop(cluster: None, make_engine: Any, tiny_model_path: Path):
    scheduler = (
        ray.remote(AsyncRolloutActor)
        .options(num_cpus=1)
        .remote(CONFIG, make_engine, str(tiny_model_path))
    )
    try:
        assert seed_loop(scheduler, tiny_model_path) == [1, 2]
    finally:
        ray.kill(scheduler)


def test_an_engine_does_not_pickle_and_names_the_recipe(vllm_engine: Any) -> None:
    import cloudpickle

    for dumps in (pickle.dumps, cloudpickle.dumps):
        with pytest.raises(TypeError, match=r"VLLMEngine cannot be pickled.*functools\.partial"):
            dumps(vllm_engine)
