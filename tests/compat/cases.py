"""Batches for the layout tests (ROLL, verl): real pipeline batches with the trajectories
they were built from, rewards to make GRPO groups differ, and hypothesis trajectories.

Imported as ``compat.cases`` by ``tests/test_roll_layout.py`` and
``tests/test_verl_layout.py`` and by the verl tests in this folder.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torchdata.nodes import Mapper

from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
from rollpipe.data.proto import DataProto
from rollpipe.data.proto.columns import object_array
from rollpipe.nodes.batch import TrajectoryBatch
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

BASE: dict[str, Any] = dict(
    envs="frozenlake",
    group_size=4,
    batch_size=8,
    num_groups=2,
    max_turns=3,
    max_length=512,
    concurrency=16,
    seed=5,
    sampling={"max_tokens": 16, "temperature": 1.0},
)


def pipeline_batch(engine: Any, tokenizer: Any, **changes: Any) -> tuple[DataProto, list]:
    """One batch of a real ``RolloutPipeline`` and the trajectories Collate built it from."""
    seen: list[TrajectoryBatch] = []

    def keep(item: TrajectoryBatch) -> TrajectoryBatch:
        seen.append(item)
        return item

    config = PipelineConfig(**(BASE | changes))
    with RolloutPipeline(
        config, engine, tokenizer, hooks={"batch": lambda n: Mapper(n, keep)}
    ) as pipe:
        batch = pipe.get_batch()
    assert batch is not None
    episodes = sorted(set(batch.batch["traj_id"].tolist()))
    for item in seen:
        trajectories = list(item.trajectories)
        if sorted(t.episode_id for t in trajectories) == episodes:
            return batch, trajectories
    raise AssertionError("no captured TrajectoryBatch matches the batch")


def with_observations(batch: DataProto, trajectories: list[Trajectory]) -> DataProto:
    """Step rows plus the ``observations`` column ROLL's ``state_hash`` needs (each row's
    ``Turn.observation``; step rows list each trajectory's turns in order)."""
    out = batch.clone()
    out.non_tensor_batch["observations"] = object_array(
        u.observation for t in trajectories for u in t.turns
    )
    return out


def rescored(batch: DataProto, seed: int = 0) -> DataProto:
    """``batch`` (trajectory rows) with new turn rewards, written everywhere native rows
    keep rewards (``step_scores``, the last-token ``scores``, ``episode_scores``), so GRPO
    groups have different scores; the tokens stay the pipeline's."""
    out = batch.clone()
    rng = np.random.default_rng(seed)
    values = np.array([-1.0, -0.1, 0.0, 0.25, 1.0])
    turn_rewards = [[float(v) for v in rng.choice(values, len(s))] for s in out["step_scores"]]
    totals = [sum(r) for r in turn_rewards]
    scores = out.batch["scores"]
    last = out.batch["attention_mask"].sum(1) - 1
    scores.zero_()
    scores[torch.arange(len(out)), last] = torch.tensor(totals, dtype=torch.float32)
    out.batch["episode_scores"] = torch.tensor(totals, dtype=torch.float32)
    out.non_tensor_batch["step_scores"] = object_array(turn_rewards)
    return out


REWARDS = st.sampled_from([-1.0, -0.1, 0.0, 0.1, 0.5, 1.0])


@st.composite
def turns(draw: st.DrawFn, windowed: bool) -> Turn:
    prompt = draw(st.lists(st.integers(3, 90), min_size=1, max_size=6))
    n = draw(st.integers(1, 5))
    version = draw(st.integers(0, 3))
    return Turn(
        prompt_ids=prompt,
        response_ids=draw(st.lists(st.integers(3, 90), min_size=n, max_size=n)),
        logprobs=draw(st.lists(st.floats(-5.0, -0.01), min_size=n, max_size=n)),
        versions=[version] * n if windowed else [version + i for i in range(n)],
        reward=draw(REWARDS),
        finish_reason="stop",
        action_valid=True,
        action_text="<answer>Left</answer>",
        observation=draw(st.sampled_from(["FFFG", "SFHF", "café ☃", ""])),
    )


@st.composite
def trajectories(draw: st.DrawFn, windowed: bool = False) -> list[Trajectory]:
    """A few groups of multi-turn trajectories (window-mode ones when ``windowed``)."""
    out = []
    episode = 0
    for group in range(draw(st.integers(1, 3))):
        tag = draw(st.sampled_from(["frozenlake", "sokoban"]))
        for _ in range(draw(st.integers(1, 3))):
            ts = draw(st.lists(turns(windowed), min_size=1, max_size=3))
            out.append(
                Trajectory(
                    spec=EpisodeSpec(group_id=group, episode_id=episode, seed=7, tag=tag),
                    env_id=draw(st.integers(0, 2)),
                    turns=ts,
                    score=sum(u.reward for u in ts),
                    success=False,
                    end_reason="max_turns",
                    history_window=2 if windowed else None,
                )
            )
            episode += 1
    return out
