"""RayEngine: vLLM engines in Ray actors on a local cluster, behind an EnginePool.

One local cluster (``ray.init(num_cpus=4)``) and one pool of two actors per module.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from waiting import wait_until

from rollpipe.engines.pool import EnginePool
from rollpipe.engines.ray_engine import RayEngine, ray_pool
from rollpipe.engines.records import EngineError, SamplingParams
from rollpipe.engines.vllm import VLLMEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

ray = pytest.importorskip("ray")  # the dev extra installs it: CI always runs these

CONFIG = PipelineConfig(
    group_size=4,
    batch_size=8,
    max_turns=3,
    max_length=512,
    concurrency=8,
    seed=21,
    sampling={"max_tokens": 16},
)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=200 << 20,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster: None, tiny_model_path: Path) -> Iterator[EnginePool]:
    make = functools.partial(VLLMEngine, str(tiny_model_path), kv_cache_space_gib=0.25)
    engines = ray_pool(make, 2, num_cpus=1)
    yield engines
    engines.close()


def actor_pid(engine: Any) -> int:
    return int(ray.get(engine.actor.pid.remote(), timeout=30))


def gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether the actor's process ends within ``timeout`` (Ray kills it on ray.kill)."""
    import psutil

    def ended() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return wait_until(ended, timeout, f"the actor's process {pid} to end")


def test_pipeline_on_ray_engines_matches_the_in_process_engine(
    pool: EnginePool, vllm_engine: Any, tokenizer: Any
) -> None:
    with RolloutPipeline(CONFIG, pool, tokenizer) as pipe:
        batch = pipe.get_batch()
    assert len(batch) == 8 and set(Counter(batch.batch["traj_group_id"].tolist()).values()) == {4}
    assert {rank for _, rank in pool.routing_log} == {0, 1}
    prompts = [list(range(3, 20)), list(range(30, 41))]
    remote = pool.generate_batch(prompts * 2, GREEDY)
    local = vllm_engine.generate_batch(prompts * 2, GREEDY)
    assert [g.token_ids for g in remote] == [g.token_ids for g in local]
    assert all(len(g.logprobs) == len(g.versions) == 10 for g in remote)
    for a, b in zip(remote, local, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_weights_go_to_the_object_store_once_per_update(
    pool: EnginePool, tiny_model_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    store = pool.engine(0).weights  # type: ignore[union-attr]
    assert pool.engine(1).weights is store  # type: ignore[union-attr]
    puts = store.puts
    state = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).state_dict()
    version = pool.update_weights(state)
    assert store.puts == puts + 1 and all(pool.engine(r).version == version for r in (0, 1))


def test_a_repeated_version_with_other_weights_is_put_again(
    pool: EnginePool, tiny_model_path: Path
) -> None:
    """The store knows an update by its tensors, not its version alone: the same
    explicit version with other tensors, or with the same tensors stepped in place, is
    a new copy; the same unchanged tensors again are not."""
    from transformers import AutoModelForCausalLM

    store = pool.engine(0).weights  # type: ignore[union-attr]
    state = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).state_dict()
    version = pool.version + 1
    pool.update_weights(state, version=version)
    puts = store.puts
    pool.update_weights(state, version=version)  # the same tensors, unchanged: no copy
    assert store.puts == puts
    other = {name: t.clone() for name, t in state.items()}
    name = "model.norm.weight"
    other[name].fill_(0.5)
    pool.update_weights(other, version=version)  # same version, other tensors
    assert store.puts == puts + 1
    assert dict(ray.get(store.ref))[name].eq(0.5).all()
    other[name].fill_(0.25)  # the same tensors, stepped in place
    pool.update_weights(other, version=version)
    assert store.puts == puts + 2
    assert dict(ray.get(store.ref))[name].eq(0.25).all()
    pool.update_weights(state)  # the model's own weights back for the tests after
    assert dict(ray.get(store.ref))[name].equal(state[name])


def test_shrink_and_expand_across_actors(pool: EnginePool, tiny_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    leaving = pool.engine(1)
    assert isinstance(leaving, RayEngine)
    pid = actor_pid(leaving)
    result = pool.shrink([1])
    assert result["offload_ranks"] == [1] and pool.active_ranks == [0]
    assert gone(pid)  # its actor's process ended: the memory is free
    state = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).state_dict()
    version = pool.update_weights(state)
    back = pool.expand([1])
    assert back["load_ranks"] == [1] and pool.engine(1).version == version  # type: ignore[union-attr]
    assert actor_pid(pool.engine(1)) != pid  # a new actor


def test_a_killed_actor_loses_no_trajectory_and_is_reported(
    pool: EnginePool, tokenizer: Any
) -> None:
    cfg = CONFIG.replace(sampling={"max_tokens": 64, "ignore_eos": True}, seed=22)
    with RolloutPipeline(cfg, pool, tokenizer) as pipe:
        out: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: out.update(batch=pipe.get_batch()))
        thread.start()
        wait_until(
            lambda: any(load.rank == 1 and load.requests for load in pool.loads()),
            60,
            "a request on rank 1",
        )
        victim = pool.engine(1)
        assert isinstance(victim, RayEngine)
        ray.kill(victim.actor)
        thread.join(120)
        assert not thread.is_alive()
    batch = out["batch"]
    assert len(batch) == 8 and len(set(batch.batch["traj_id"].tolist())) == 8
    assert pool.active_ranks == [0]
    error = pool.failures()[1]
    assert isinstance(error, EngineError) and "rank 1" in str(error)
    assert not victim.alive
    with pytest.raises(EngineError, match="actor died"):
        victim.generate_batch([[1, 2, 3]], GREEDY)
    pool.expand([1])
    assert pool.active_ranks == [0, 1] and pool.failures() == {}


def test_pause_modes_weights_and_close_through_the_actor(
    cluster: None, tiny_model_path: Path
) -> None:
    """keep: frozen requests continue after an update, their tokens labelled with both
    versions; abort: in-flight requests end with their partial tokens; close: the
    actor's process ends."""
    from transformers import AutoModelForCausalLM

    make = functools.partial(VLLMEngine, str(tiny_model_path), kv_cache_space_gib=0.25)
    engine = RayEngine(make, num_cpus=1)
    pid = actor_pid(engine)
    state = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).state_dict()
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def in_flight() -> list[asyncio.Future[Any]]:
        tasks = [asyncio.ensure_future(engine.generate([5, 6, 7, 8], long)) for _ in range(2)]
        await engine.generate([5, 6], GREEDY.replace(max_tokens=2))  # both are running now
        return tasks

    async def main() -> tuple[list[Any], list[Any], int]:
        tasks = await in_flight()
        await asyncio.to_thread(engine.pause, "keep")
        version = await asyncio.to_thread(engine.update_weights, state)
        await asyncio.to_thread(engine.resume)
        kept = list(await asyncio.gather(*tasks))
        tasks = await in_flight()
        await asyncio.to_thread(engine.pause, "abort")
        aborted = list(await asyncio.gather(*tasks))
        await asyncio.to_thread(engine.resume)
        return kept, aborted, version

    kept, aborted, version = asyncio.run(main())
    for gen in kept:
        assert len(gen.token_ids) == 400 and set(gen.versions) == {version - 1, version}
    for gen in aborted:
        assert gen.finish_reason == "abort" and 0 < len(gen.token_ids) < 400
        assert set(gen.versions) == {version}
    engine.close()
    assert gone(pid), "the actor outlived close()"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(engine.actor.pid.remote(), timeout=30)
    with pytest.raises(EngineError):
        engine.generate_batch([[5, 6, 7]], GREEDY)


def test_a_hosted_engine_error_is_the_callers_not_a_death(pool: EnginePool) -> None:
    with pytest.raises(EngineError, match="hosted engine"):
        pool.generate_batch([list(range(3000))], GREEDY)  # longer than max_model_len
    assert pool.active_ranks == [0, 1] and pool.failures() == {}
    assert torch.tensor(0).item() == 0
