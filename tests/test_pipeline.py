"""RolloutPipeline end to end on the real vLLM engine and the tiny local model."""

from __future__ import annotations

import re
import threading
from typing import ClassVar

import numpy as np
import pytest
import torch
from waiting import wait_until

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.envs import FrozenLake, register
from rollpipe.nodes.episode_source import EpisodeSource
from rollpipe.nodes.rollout import RunnerSettings
from rollpipe.pipeline import PipelineConfig, RolloutPipeline
from rollpipe.runtime import Runtime

SAMPLING = {"max_tokens": 16, "temperature": 1.0}


def config(**changes) -> PipelineConfig:
    base = dict(
        envs="frozenlake",
        group_size=4,
        batch_size=8,
        num_groups=4,
        max_turns=2,
        max_length=512,
        concurrency=16,
        seed=3,
        sampling=SAMPLING,
    )
    return PipelineConfig(**(base | changes))


def rows_of(batch):
    """Per-row (traj uid, real input ids) — what must match between equal runs."""
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    return [
        (batch.non_tensor_batch["traj_uid"][i], tuple(ids[i][mask[i]].tolist()))
        for i in range(len(batch))
    ]


def assert_valid(batch, expected_rows: int) -> None:
    assert len(batch) == expected_rows
    td = batch.batch
    attention, response, prompt = (
        td["attention_mask"].bool(),
        td["response_mask"].bool(),
        td["prompt_mask"].bool(),
    )
    assert not (response & ~attention).any()
    assert not (prompt & response).any()
    assert (td["position_ids"] == (td["attention_mask"].cumsum(-1) - 1).clamp(min=0)).all()
    # no row repeats, and members of a group share the seed and first observation
    uids = list(batch.non_tensor_batch["traj_uid"])
    assert len(set(uids)) == len(uids)
    assert len(set(td["traj_id"].tolist())) == len(uids)
    for gid in set(td["traj_group_id"].tolist()):
        rows = (td["traj_group_id"] == gid).nonzero().flatten().tolist()
        first_prompts = {tuple(td["input_ids"][r][prompt[r]].tolist()) for r in rows}
        assert len(first_prompts) == 1, f"group {gid} members saw different first prompts"
    metrics = batch.meta_info["metrics"]
    for key in (
        "episode_score/mean",
        "success_rate",
        "turns/mean",
        "response_length/mean",
        "throughput/tokens_per_s",
        "time/env_s",
        "time/engine_wait_s",
        "dropped/filtered",
        "dropped/stale",
        "dropped/errored",
    ):
        assert key in metrics, key
    assert metrics["trajectories"] == expected_rows


def test_batches_are_valid_and_complete(vllm_engine, tokenizer):
    with RolloutPipeline(config(), vllm_engine, tokenizer) as pipe:
        batches = list(pipe)
    assert [len(b) for b in batches] == [8, 8]
    for b in batches:
        assert_valid(b, 8)
    ids = torch.cat([b.batch["traj_id"] for b in batches]).tolist()
    assert sorted(ids) == list(range(16))  # every episode exactly once


def test_same_config_gives_identical_batches(vllm_engine, tokenizer):
    runs = []
    for _ in range(2):
        with RolloutPipeline(config(), vllm_engine, tokenizer) as pipe:
            runs.append([rows_of(b) for b in pipe])
    assert runs[0] == runs[1]


def test_checkpoint_restore_continues_exactly(vllm_engine, tokenizer):
    cfg = config(num_groups=6)
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        uninterrupted = [rows_of(b) for b in pipe]
    assert len(uninterrupted) == 3
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        first = rows_of(pipe.get_batch())
        state = plain_round_trip(pipe.state_dict())
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as restored:
        restored.load_state_dict(state)
        rest = [rows_of(b) for b in restored]
    assert [first, *rest] == uninterrupted


def plain_round_trip(state):
    """``state`` through torch.save / torch.load(weights_only=True), after checking it is
    JSON apart from tensors: plain data, no live objects."""
    import io
    import json

    def tensors_only(obj):
        if isinstance(obj, torch.Tensor):
            return obj.tolist()
        raise TypeError(f"state holds a {type(obj).__name__}: {obj!r}")

    json.dumps(state, default=tensors_only)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_suspend_update_resume_loses_nothing(vllm_engine, tokenizer, tiny_model_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    # collection runs ahead (no ratio bound): the next group is in flight at suspend
    cfg = config(concurrency=4, async_generation_ratio=None)
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        first = pipe.get_batch()
        old_version = pipe.version
        pipe.suspend("keep", hold=True)
        with pytest.raises(RuntimeError, match="holds the suspension"):
            next(pipe)  # iterating a pipeline this very thread holds would never end
        new_version = pipe.update_weights(policy)
        pipe.resume()
        second = pipe.get_batch()
        assert pipe.get_batch() is None
    assert new_version == old_version + 1
    ids = sorted(first.batch["traj_id"].tolist() + second.batch["traj_id"].tolist())
    assert ids == list(range(16))
    versions = second.batch["policy_versions"][second.batch["response_mask"].bool()]
    assert (versions == new_version).any()
    assert set(versions.unique().tolist()) <= {old_version, new_version}


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_suspend_from_another_thread_while_a_batch_fills(vllm_engine, tokenizer, mode):
    cfg = config(num_groups=2, max_turns=3, concurrency=8)
    out: dict[str, object] = {}
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        start = vllm_engine.tokens_generated
        worker = threading.Thread(target=lambda: out.setdefault("batch", pipe.get_batch()))
        worker.start()
        # the batch is filling (a get_batch that starts after a plain suspend resumes it)
        wait_until(lambda: vllm_engine.tokens_generated > start, 60, "the batch's first tokens")
        for _ in range(3):
            pipe.suspend(mode)
            assert pipe.suspension.is_suspended
            pipe.resume()
        worker.join(timeout=300)
        assert not worker.is_alive(), "get_batch hung across suspend/resume"
    batch = out["batch"]
    assert_valid(batch, 8)
    assert sorted(batch.batch["traj_id"].tolist()) == list(range(8))
    # aborted turns are regenerated: every response is a complete engine output
    assert set(batch.non_tensor_batch["end_reasons"]) <= {"terminated", "truncated", "max_turns"}


class FlakyLake:
    """FrozenLake whose step raises for ``CRASH_SEEDS``: a stand-in for a crashing env."""

    def __init__(self) -> None:
        self.inner = FrozenLake()
        self.crash = False

    def reset(self, seed: int):
        self.crash = seed in CRASH_SEEDS
        return self.inner.reset(seed)

    def step(self, action_text: str):
        if self.crash:
            raise RuntimeError("simulated env crash")
        return self.inner.step(action_text)

    def close(self) -> None:
        pass


register("flaky_lake", FlakyLake, overwrite=True)


FLAKY = config(
    envs="flaky_lake", group_size=2, batch_size=2, num_groups=4, max_turns=1, on_length="step"
)
# Two of the four groups' env seeds: their episodes crash at their first step.
CRASH_SEEDS = {spec.seed for spec in EpisodeSource(4, 2, FLAKY.seed, "flaky_lake")}
CRASH_SEEDS = set(sorted(CRASH_SEEDS)[::2])


def test_erroring_env_drops_group_and_goes_on(vllm_engine, tokenizer):
    cfg = FLAKY
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        batches = list(pipe)
    # dropped groups were replaced, so all 4 requested groups arrive
    assert len(batches) == 4
    errored = sum(b.meta_info["metrics"]["dropped/errored"] for b in batches)
    errored += pipe.nodes.groups.pending_drops.get("errored", 0)
    assert errored >= len(CRASH_SEEDS)
    for b in batches:
        assert "error" not in set(b.non_tensor_batch["end_reasons"])

    with (
        RolloutPipeline(cfg.replace(raise_env_errors=True), vllm_engine, tokenizer) as pipe,
        pytest.raises(RuntimeError, match="simulated env crash"),
    ):
        list(pipe)


def test_redundancy_keeps_groups_whole(vllm_engine, tokenizer):
    cfg = config(redundancy=2, num_groups=2)
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        batch = pipe.get_batch(-1)
        assert pipe.get_batch() is None
    assert_valid(batch, 8)
    counts = np.unique(batch.batch["traj_group_id"].numpy(), return_counts=True)[1]
    assert counts.tolist() == [4, 4]


def test_engine_death_raises_promptly(tiny_model_path, tokenizer):
    from rollpipe.engines.hf import HFEngine
    from rollpipe.engines.records import EngineError

    engine = HFEngine(tiny_model_path)
    pipe = RolloutPipeline(config(num_groups=None), engine, tokenizer)
    assert len(pipe.get_batch()) == 8
    engine.close()
    with pytest.raises(EngineError):
        pipe.get_batch()
    pipe.close()


def test_bad_configuration_names_the_field():
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        PipelineConfig(group_size=0)
    with pytest.raises(ValueError, match="batch_size=6 is not a multiple of group_size=4"):
        PipelineConfig(batch_size=6, group_size=4)
    with pytest.raises(ValueError, match="unknown env 'nolake'"):
        PipelineConfig(envs="nolake")
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        PipelineConfig.from_dict({"colour": "red"})
    with pytest.raises(ValueError, match=r"sampling: unknown keys \['temp'\]"):
        PipelineConfig(sampling={"temp": 1.0})
    with pytest.raises(ValueError, match="env_workers must be an int >= 0, got -1"):
        PipelineConfig(env_workers=-1)
    with pytest.raises(ValueError, match="max_drops_in_a_row must be an int >= 1, got 0"):
        PipelineConfig(max_drops_in_a_row=0)


def test_step_level_rows(vllm_engine, tokenizer):
    cfg = config(level="step", history_window=2, num_groups=2, max_turns=3)
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        batch = pipe.get_batch()
    td = batch.batch
    # one row per turn: more rows than trajectories, each with its step index and state hash
    assert len(batch) > 8
    assert set(td["traj_id"].tolist()) == set(range(8))
    assert td["step"].min().item() == 0 and td["step"].max().item() <= 2
    assert (td["response_mask"].sum(-1) > 0).all()
    first_steps = td["step"] == 0
    for gid in set(td["traj_group_id"].tolist()):
        hashes = td["state_hash"][first_steps & (td["traj_group_id"] == gid)]
        assert len(set(hashes.tolist())) == 1  # same start state within a group


def test_user_nodes_between_stages_and_stages_alone(vllm_engine, tokenizer):
    from torchdata.nodes import Loader, Mapper

    from rollpipe.agent.records import Trajectory
    from rollpipe.nodes.episode_source import EpisodeSource
    from rollpipe.nodes.rollout import EpisodeRunner

    seen = []

    def reward_model(traj: Trajectory) -> Trajectory:
        seen.append(traj.traj_id)
        return traj

    with RolloutPipeline(
        config(num_groups=2),
        vllm_engine,
        tokenizer,
        hooks={"rollout": lambda node: Mapper(node, reward_model)},
    ) as pipe:
        batch = pipe.get_batch()
    assert sorted(seen) == sorted(batch.non_tensor_batch["traj_uid"])

    episode = EpisodeSettings(max_turns=1, sampling=config().episode.sampling)
    rollout = EpisodeRunner(EpisodeSource(1, 3, seed=1), vllm_engine, tokenizer, episode=episode)
    trajectories = list(Loader(rollout))
    rollout.close()
    assert [t.episode_id for t in trajectories] == [0, 1, 2]
    assert len({t.initial_observation for t in trajectories}) == 1


def test_close_leaves_no_threads_behind(vllm_engine, tokenizer):
    before = {t.ident for t in threading.enumerate()}
    pipe = RolloutPipeline(config(num_groups=None, env_workers=3), vllm_engine, tokenizer)
    pipe.get_batch()
    pipe.close()
    pipe.close()  # idempotent
    leftover = [t.name for t in threading.enumerate() if t.ident not in before]
    assert leftover == []
    with pytest.raises(RuntimeError, match="closed"):
        pipe.get_batch()


def test_collection_continues_between_batches(vllm_engine, tokenizer):
    """With ``async_generation_ratio=1`` the next batch's episodes run in the background
    while the trainer works on this one."""
    from waiting import wait_until

    cfg = config(num_groups=4, concurrency=4, max_turns=1, async_generation_ratio=1)
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        pipe.get_batch()
        # "training": nobody asks for data, yet the next batch's episodes finish
        wait_until(lambda: pipe.nodes.rollout.num_buffered >= 4, 60, "episodes collected")
        assert len(pipe.get_batch()) == 8


class ThreadNotingLake(FrozenLake):
    """FrozenLake that notes which thread ran each of its calls (declared inline, like
    FrozenLake: the declaration is not inherited)."""

    blocking = False
    threads: ClassVar[set[str]] = set()

    def reset(self, seed: int):
        ThreadNotingLake.threads.add(threading.current_thread().name)
        return super().reset(seed)

    def step(self, action_text: str):
        ThreadNotingLake.threads.add(threading.current_thread().name)
        return super().step(action_text)


register("thread_noting_lake", ThreadNotingLake, overwrite=True)


class OnItsOwnRuntime:
    """The real engine, seen through a runtime of its own: episodes run there and reach
    the engine through its bridge (as bench/overhead.py runs them, to time them apart)."""

    def __init__(self, engine):
        self._engine = engine
        self.runtime = Runtime("rollpipe-episodes")

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize(("workers", "own_runtime"), [(0, False), (0, True), (2, False)])
def test_env_calls_run_inline_or_on_the_env_pool(vllm_engine, tokenizer, workers, own_runtime):
    """Episodes run on the engine's runtime thread (or on the runtime the engine object
    names); env calls run inline there, or on the env pool when ``env_workers > 0``."""
    from torchdata.nodes import Loader

    from rollpipe.nodes.rollout import EpisodeRunner

    ThreadNotingLake.threads = set()
    engine = OnItsOwnRuntime(vllm_engine) if own_runtime else vllm_engine
    rollout = EpisodeRunner(
        EpisodeSource(2, 2, seed=1, envs="thread_noting_lake"),
        engine,
        tokenizer,
        RunnerSettings(env_workers=workers),
        EpisodeSettings(max_turns=2, sampling=config().episode.sampling),
    )
    try:
        assert len(list(Loader(rollout))) == 4
    finally:
        rollout.close()
        if own_runtime:
            engine.runtime.close()
    if workers:
        assert ThreadNotingLake.threads
        assert all(name.startswith("rollpipe-env") for name in ThreadNotingLake.threads)
    elif own_runtime:
        assert ThreadNotingLake.threads == {"rollpipe-episodes"}
    else:
        assert ThreadNotingLake.threads == {vllm_engine.runtime.thread.name}


def test_asking_for_data_on_the_engine_loop_raises_not_hangs(vllm_engine, tokenizer):
    """The episodes run on the engine's loop; blocking on them from that very loop would
    deadlock, so it is an error instead."""
    import asyncio

    from rollpipe.nodes.rollout import EpisodeRunner

    episode = EpisodeSettings(max_turns=1)
    rollout = EpisodeRunner(EpisodeSource(1, 2, seed=1), vllm_engine, tokenizer, episode=episode)
    rollout.reset()

    async def next_on_engine_loop():
        return next(rollout)

    loop = vllm_engine.runtime.loop
    try:
        with pytest.raises(RuntimeError, match="call it from another thread"):
            asyncio.run_coroutine_threadsafe(next_on_engine_loop(), loop).result(timeout=60)
        assert next(rollout).episode_id == 0  # from this thread it works
    finally:
        rollout.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("raise_env_errors", "no"),
        ("raise_env_errors", 1),
        ("in_order", "yes"),
        ("system_prompt", 123),
        ("history_window", -1),
        ("history_window", 1.5),
        ("async_generation_ratio", 1.5),
    ],
)
def test_bad_config_values_name_the_field(field: str, value: object) -> None:
    named = r"(PipelineConfig|EpisodeSettings|RunnerSettings)"
    with pytest.raises(ValueError, match=rf"{named}\.{field}.*{re.escape(repr(value))}"):
        PipelineConfig(**{field: value})


def test_max_length_beyond_the_engine_is_caught_at_build(vllm_engine, tokenizer) -> None:
    too_long = vllm_engine.max_model_len + 1
    with pytest.raises(ValueError, match=rf"max_length={too_long} .* max_model_len="):
        RolloutPipeline(PipelineConfig(max_length=too_long), vllm_engine, tokenizer)
