"""Weight sync by broadcast (``weight_sync="broadcast"``): real vLLM engines in Ray actors
get each update over a gloo group from the trainer (this process), and generate exactly
what the same weights give through the object store.

One local Ray cluster per module: a 2-rank broadcast pool and an object-store engine as
the reference (three actors, most of this module's time is their start). The test that
kills a rank of the pool comes last (pytest keeps the file's order).
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollpipe.engines.pool import EnginePool
from rollpipe.engines.ray_engine import BroadcastChannel, RayEngine, WeightStore, ray_pool
from rollpipe.engines.records import EngineError, SamplingParams
from rollpipe.engines.vllm import VLLMEngine

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [9]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        address="local",  # a cluster of its own, even where another one runs
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 << 20,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def make_engine(tiny_model_path: Path) -> Any:
    return functools.partial(VLLMEngine, str(tiny_model_path), kv_cache_space_gib=0.25)


@pytest.fixture(scope="module")
def base_weights(tiny_model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict())


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New weights that change what the tiny model generates."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


@pytest.fixture(scope="module")
def broadcast_pool(cluster: None, make_engine: Any) -> Iterator[EnginePool]:
    # a short limit: a host left waiting by a failed send gives up after it
    pool = ray_pool(
        make_engine, 2, num_cpus=1, weight_sync="broadcast", update_weights_timeout_s=20
    )
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def reference(cluster: None, make_engine: Any) -> Iterator[RayEngine]:
    engine = RayEngine(make_engine, num_cpus=1)  # the object store, as by default
    yield engine
    engine.close()


def channel_of(pool: EnginePool) -> BroadcastChannel:
    engine = pool.engine(0)
    assert isinstance(engine, RayEngine) and isinstance(engine.weights, BroadcastChannel)
    return engine.weights


def rank_generations(pool: EnginePool, rank: int) -> list[Any]:
    engine = pool.engine(rank)
    assert engine is not None
    return engine.generate_batch(PROMPTS, GREEDY)  # type: ignore[attr-defined, no-any-return]


def hosted_version(engine: Any) -> int:
    return int(ray.get(engine.actor.version.remote(), timeout=60))


def test_both_ranks_get_one_broadcast_and_generate_as_the_object_store_path(
    broadcast_pool: EnginePool, reference: RayEngine, base_weights: dict[str, torch.Tensor]
) -> None:
    channel = channel_of(broadcast_pool)
    assert isinstance(reference.weights, WeightStore)
    for seed in (1, 2):  # the group formed by the first update carries the second
        weights = perturbed(base_weights, seed)
        before = [rank_generations(broadcast_pool, r) for r in (0, 1)]
        sent = channel.broadcasts
        version = broadcast_pool.update_weights(weights)
        expected_version = reference.update_weights(weights)
        assert version == expected_version == broadcast_pool.version
        assert channel.broadcasts == sent + 1  # one broadcast reached both ranks
        expected = reference.generate_batch(PROMPTS, GREEDY)
        for rank in (0, 1):
            engine = broadcast_pool.engine(rank)
            assert engine is not None and engine.version == version
            assert hosted_version(engine) == version
            gens = rank_generations(broadcast_pool, rank)
            assert [g.token_ids for g in gens] != [g.token_ids for g in before[rank]]
            assert [g.token_ids for g in gens] == [g.token_ids for g in expected]
            assert [g.logprobs for g in gens] == [g.logprobs for g in expected]  # bitwise
            assert {v for g in gens for v in g.versions} == {version}
    assert channel.groups_formed == 1  # the same two hosts: the group was kept


@pytest.mark.parametrize("wrong", ["name", "shape", "dtype"])
def test_weights_unlike_the_first_update_are_refused_before_anything_is_sent(
    broadcast_pool: EnginePool, base_weights: dict[str, torch.Tensor], wrong: str
) -> None:
    channel = channel_of(broadcast_pool)
    if channel.layout is None:  # this test alone: give the channel its first update
        broadcast_pool.update_weights(perturbed(base_weights, 3))
    assert channel.layout is not None
    version, sent = broadcast_pool.version, channel.broadcasts
    before = [rank_generations(broadcast_pool, r) for r in (0, 1)]
    weights = perturbed(base_weights, 4)
    name = "model.layers.0.mlp.down_proj.weight"
    if wrong == "name":
        weights["model.layers.0.mlp.down_proj.weights"] = weights.pop(name)
        says = "'model.layers.0.mlp.down_proj.weights' is not a weight of the layout"
    elif wrong == "shape":
        weights[name] = weights[name][:, :-1]
        says = f"{name!r} is {tuple(weights[name].shape)}"
    else:
        weights[name] = weights[name].to(torch.float16)
        says = "torch.float16, the layout has"
    with pytest.raises(ValueError) as caught:
        broadcast_pool.update_weights(weights)
    message = str(caught.value)
    assert (
        says in message and "nothing was sent" in message and "weight_sync='broadcast'" in message
    )
    assert channel.broadcasts == sent and broadcast_pool.version == version
    for rank in (0, 1):
        engine = broadcast_pool.engine(rank)
        assert engine is not None and engine.version == version == hosted_version(engine)
        after = rank_generations(broadcast_pool, rank)
        assert [g.logprobs for g in after] == [g.logprobs for g in before[rank]]


def test_the_knob_is_checked_before_an_actor_starts() -> None:
    with pytest.raises(ValueError, match="weight_sync='nccl'; choose 'object_store'"):
        RayEngine(lambda: None, weight_sync="nccl")  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="weights is a WeightStore but weight_sync='broadcast'"):
        RayEngine(lambda: None, weights=WeightStore(), weight_sync="broadcast")  # type: ignore[arg-type, return-value]


def test_a_rank_killed_before_a_broadcast_leaves_the_pool_and_the_rest_is_updated(
    broadcast_pool: EnginePool, base_weights: dict[str, torch.Tensor]
) -> None:
    pool = broadcast_pool  # the module's last test: it takes rank 1 out for good
    first_version = pool.update_weights(perturbed(base_weights, 5))
    first = rank_generations(pool, 0)
    victim = pool.engine(1)
    assert victim is not None
    os.kill(int(ray.get(victim.actor.pid.remote(), timeout=60)), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):  # Ray knows it is dead
        ray.get(victim.actor.version.remote(), timeout=60)
    assert victim.alive  # the pool and the channel do not, yet

    weights = perturbed(base_weights, 6)
    try:  # the group still holds the dead host: the send to it fails
        version = pool.update_weights(weights)
    except EngineError as e:  # rank 0 waited for data the trainer could not finish sending
        assert "engine host #" in str(e) and "died" in str(e) and "again" in str(e)
        version = pool.update_weights(weights)  # a new group, with the live host only
    assert version == first_version + 1 == pool.version
    assert pool.active_ranks == [0] and list(pool.failures()) == [1]
    assert "died" in str(pool.failures()[1]) and not victim.alive
    survivor = pool.engine(0)
    assert survivor is not None and survivor.version == version == hosted_version(survivor)
    gens = rank_generations(pool, 0)
    assert [g.token_ids for g in gens] != [g.token_ids for g in first]
    assert {v for g in gens for v in g.versions} == {version}
    assert pool.generate_batch(PROMPTS, GREEDY)[0].token_ids == gens[0].token_ids
