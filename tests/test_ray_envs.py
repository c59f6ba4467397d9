"""Envs on Ray workers: RayEnv on a local cluster, alone and inside the rollout chain.

One local cluster per module (started here unless one is already up). The chain is
wired from the node classes as ``build_nodes`` wires it, with ``env_factory`` added.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torchdata.nodes import Loader, Mapper
from waiting import wait_until

from rollpipe.agent.chat import ChatFormat
from rollpipe.envs import FrozenLake, make, register
from rollpipe.envs.ray_env import RayEnv, RayEnvError, ray_env_factory
from rollpipe.nodes.batch import Batch
from rollpipe.nodes.closing import close_chain
from rollpipe.nodes.collate import Collate
from rollpipe.nodes.episode_source import EnvChoice, EpisodeSource
from rollpipe.nodes.groups import GroupAssembler
from rollpipe.nodes.rollout import EpisodeRunner, RunnerSettings
from rollpipe.nodes.signals import PipelineSignals
from rollpipe.pipeline import PipelineConfig

ray = pytest.importorskip("ray")  # the dev extra installs it: CI always runs these
psutil = pytest.importorskip("psutil")

GREEDY = {"max_tokens": 16, "temperature": 0.0}
MIXED = PipelineConfig(
    envs=[EnvChoice("frozenlake"), EnvChoice("sokoban", {"dim_room": (5, 5)})],
    group_size=2,
    batch_size=4,
    num_groups=4,
    max_turns=2,
    max_length=512,
    concurrency=4,
    seed=5,
    sampling=GREEDY,
    async_generation_ratio=None,  # no grants: the chain below runs on its own
)


class CrashOnceLake(FrozenLake):
    """FrozenLake whose process dies (``os._exit``) at the first step any instance takes:
    the first to create ``crash_marker`` exits; the others play on."""

    def __init__(self, *, crash_marker: str, **config: Any) -> None:
        super().__init__(**config)
        self.crash_marker = crash_marker

    def step(self, action_text: str) -> Any:
        try:
            os.close(os.open(self.crash_marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return super().step(action_text)
        os._exit(1)  # the worker process dies mid-episode, as a segfaulting env would


class RaisingLake(FrozenLake):
    """FrozenLake whose ``step`` raises (the env's bug, not a crash of its process)."""

    def step(self, action_text: str) -> Any:
        raise ValueError(f"bad move {action_text!r} in lake 42")


class HangingLake(FrozenLake):
    """FrozenLake whose ``step`` never answers in time."""

    def step(self, action_text: str) -> Any:
        time.sleep(60)  # work, not a wait
        return super().step(action_text)


register("crash_once_lake", CrashOnceLake, overwrite=True)
register("raising_lake", RaisingLake, overwrite=True)
register("hanging_lake", HangingLake, overwrite=True)
# Ray workers cannot import this test module: ship its env classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    if ray.is_initialized():  # another module's cluster: use it, leave it to its owner
        yield
        return
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=200 << 20,
    )
    yield
    ray.shutdown()


def gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process ``pid`` ends within ``timeout`` (Ray kills actors asynchronously)."""

    def ended() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return wait_until(ended, timeout, f"process {pid} to end")


def run_chain(
    cfg: PipelineConfig,
    engine: Any,
    tokenizer: Any,
    env_factory: Any = None,
    trajectories: list[Any] | None = None,
) -> tuple[list[Any], GroupAssembler]:
    """Every batch of ``cfg``'s chain (EpisodeSource → EpisodeRunner → GroupAssembler → Batch
    → Collate, as ``build_nodes`` wires it), then the chain closed. Every trajectory the
    rollout yields is appended to ``trajectories``."""
    signals = PipelineSignals()
    chat = ChatFormat(tokenizer, system_prompt=cfg.episode.system_prompt)
    source = EpisodeSource.from_settings(cfg.source, signals=signals)
    rollout = EpisodeRunner(
        source,
        engine,
        chat,
        RunnerSettings(concurrency=cfg.rollout.concurrency),
        cfg.episode,
        env_factory=env_factory,
        signals=signals,
    )
    seen = trajectories if trajectories is not None else []
    recorded = Mapper(rollout, lambda t: seen.append(t) or t)
    groups = GroupAssembler(recorded, cfg.group_size, signals=signals)
    collate = Collate(Batch(groups, cfg.batch_size), tokenizer.pad_token_id)
    try:
        return list(Loader(collate, restart_on_stop_iteration=False)), groups
    finally:
        close_chain(collate)


def rows_of(batch: Any) -> list[tuple[Any, ...]]:
    """Per row: uid, real token ids, score and end reason (what equal runs share)."""
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    extra = batch.non_tensor_batch
    return [
        (
            extra["traj_uid"][i],
            tuple(ids[i][mask[i]].tolist()),
            float(batch.batch["episode_scores"][i]),
            extra["end_reasons"][i],
        )
        for i in range(len(batch))
    ]


class Recording:
    """An env factory that keeps every env it built (to look at their actors)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.built: list[RayEnv] = []

    def __call__(self, spec: Any) -> RayEnv:
        env = self.inner(spec)
        self.built.append(env)
        return env


def test_ray_envs_give_the_same_rows_as_local_envs_and_leave_no_actor(
    cluster: None, vllm_engine: Any, tokenizer: Any
) -> None:
    local, _ = run_chain(MIXED, vllm_engine, tokenizer)
    factory = Recording(ray_env_factory(num_cpus=0.25))
    remote, _ = run_chain(MIXED, vllm_engine, tokenizer, factory)
    assert [len(b) for b in remote] == [4, 4]
    assert [rows_of(b) for b in remote] == [rows_of(b) for b in local]
    assert {e.name for e in factory.built} == {"frozenlake", "sokoban"}
    assert all(e.actor is None and len(e.pids) == 1 for e in factory.built)  # closed
    assert all(gone(e.pids[0]) for e in factory.built)  # no actor process left


def test_a_crashed_worker_fails_only_its_episode_and_is_replaced(
    cluster: None, vllm_engine: Any, tokenizer: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "crashed"
    cfg = MIXED.replace(
        envs=[EnvChoice("crash_once_lake", {"crash_marker": str(marker)})], concurrency=2
    )
    factory = Recording(ray_env_factory())
    trajectories: list[Any] = []
    batches, groups = run_chain(cfg, vllm_engine, tokenizer, factory, trajectories)
    assert marker.exists()  # one worker did die
    (failed,) = [t for t in trajectories if t.end_reason == "error"]  # its episode only
    assert failed.error.startswith("RayEnvError(\"RayEnv 'crash_once_lake': its Ray actor")
    assert "died during step()" in failed.error
    assert [len(b) for b in batches] == [4, 4]  # the row counts are kept
    assert all("error" not in set(b.non_tensor_batch["end_reasons"]) for b in batches)
    errored = sum(b.meta_info["metrics"]["dropped/errored"] for b in batches)
    assert errored + groups.pending_drops.get("errored", 0) == 1  # only its group dropped
    # two env slots; the one whose worker died got a fresh actor in a new process
    assert sorted(len(e.pids) for e in factory.built) == [1, 2]
    (replaced,) = [e for e in factory.built if len(e.pids) == 2]
    assert f"(pid {replaced.pids[0]}) died" in failed.error  # the error names the dead one
    pids = [pid for e in factory.built for pid in e.pids]
    assert len(set(pids)) == 3
    assert all(gone(pid) for pid in pids)  # the dead one and, after close, the others


def test_a_killed_actor_fails_the_call_naming_it_and_reset_replaces_it(cluster: None) -> None:
    config = {"dim_room": (5, 5)}
    local = make("sokoban", **config)

    async def play() -> None:
        env = RayEnv("sokoban", config)
        try:
            assert await env.reset(11) == local.reset(11)
            actor_id = env.actor._actor_id.hex()
            ray.kill(env.actor)
            with pytest.raises(RayEnvError, match=rf"'sokoban'.*{actor_id}.*pid {env.pids[0]}"):
                await env.step("<answer>Up</answer>")
            with pytest.raises(RayEnvError, match="call reset"):
                await env.step("<answer>Up</answer>")
            assert await env.reset(11) == local.reset(11)  # a fresh actor, same episode
            assert await env.step("<answer>Up</answer>") == local.step("<answer>Up</answer>")
            assert env.actors_started == 2 and env.pids[0] != env.pids[1]
        finally:
            env.close()
        assert all(gone(pid) for pid in env.pids)

    asyncio.run(play())


def test_an_env_error_surfaces_as_the_envs_own_and_keeps_the_actor(cluster: None) -> None:
    async def play() -> None:
        env = RayEnv("raising_lake")
        try:
            await env.reset(1)
            with pytest.raises(ValueError, match="bad move 'Left' in lake 42"):
                await env.step("Left")
            await env.reset(2)
            assert env.actors_started == 1 and len(env.pids) == 1
        finally:
            env.close()

    asyncio.run(play())


def test_a_hanging_step_is_killed_after_call_timeout(cluster: None) -> None:
    async def play() -> None:
        env = RayEnv("hanging_lake", call_timeout_s=1.0)
        try:
            await env.reset(1)
            started = time.monotonic()
            with pytest.raises(RayEnvError, match=r"call_timeout_s=1.0s and was killed"):
                await env.step("<answer>Left</answer>")
            assert time.monotonic() - started < 10
            assert gone(env.pids[0])
            await env.reset(1)
            assert len(env.pids) == 2
        finally:
            env.close()

    asyncio.run(play())


def test_an_actor_the_cluster_cannot_place_fails_the_reset_saying_why(cluster: None) -> None:
    async def play() -> None:
        env = RayEnv("frozenlake", num_cpus=64, start_timeout_s=1.0)
        try:
            with pytest.raises(RayEnvError, match=r"did not start within start_timeout_s=1.0s"):
                await env.reset(1)
            assert env.actor is None and env.pids == []
        finally:
            env.close()

    asyncio.run(play())


def test_bad_options_fail_at_construction_naming_them(cluster: None) -> None:
    with pytest.raises(ValueError, match="num_cpus must be a finite number >= 0, got -1"):
        ray_env_factory(num_cpus=-1)
    with pytest.raises(ValueError, match="num_cpus given twice"):
        ray_env_factory(actor_options={"num_cpus": 1})
    with pytest.raises(ValueError, match="num_cpuz"):
        ray_env_factory(actor_options={"num_cpuz": 1})
    with pytest.raises(ValueError, match="call_timeout_s must be a number > 0"):
        ray_env_factory(call_timeout_s=0)
    with pytest.raises(ValueError, match="start_timeout_s must be a number > 0"):
        ray_env_factory(start_timeout_s=float("nan"))
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['sise'\].*'frozenlake'"):
        RayEnv("frozenlake", {"sise": 4})
    with pytest.raises(ValueError, match="unknown env 'frozen_lake'"):
        RayEnv("frozen_lake")


def test_an_env_the_workers_cannot_load_fails_every_reset_without_new_actors(
    cluster: None,
) -> None:
    module = types.ModuleType("not_on_workers")  # importable here only
    module.Lake = type("Lake", (FrozenLake,), {"__module__": "not_on_workers"})  # type: ignore[attr-defined]
    sys.modules["not_on_workers"] = module

    async def play() -> None:
        env = RayEnv("lake", factory=module.Lake)
        try:
            for _ in range(2):
                with pytest.raises(RayEnvError, match=r"no Ray actor can host.*not_on_workers"):
                    await env.reset(1)
            assert env.actors_started == 1 and env.actor is None
        finally:
            env.close()
            del sys.modules["not_on_workers"]

    asyncio.run(play())


def test_pipeline_config_env_backend_ray(cluster: None, vllm_engine: Any, tokenizer: Any) -> None:
    """``PipelineConfig(env_backend="ray")``: the same batch as local envs, greedy."""
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline

    base = PipelineConfig(
        group_size=2,
        batch_size=4,
        max_turns=2,
        concurrency=4,
        seed=5,
        sampling={"max_tokens": 12, "temperature": 0.0},
    )
    batches = []
    for backend in ("local", "ray"):
        with RolloutPipeline(base.replace(env_backend=backend), vllm_engine, tokenizer) as pipe:
            batches.append(pipe.get_batch())
    local, remote = batches
    assert torch.equal(local.batch["input_ids"], remote.batch["input_ids"])
    assert torch.equal(local.batch["scores"], remote.batch["scores"])
