"""``to_roll``: native rows in ROLL's agentic layout, checked field by field.

The reference, ``roll_rows``, re-derives ROLL's batch from the trajectory records the way
ROLL's ``TrajEnvManager`` / ``StepEnvManager.formulate_rollouts`` build one episode's rows
(token lists per history entry, padded to ``sequence_length``, ``infer_logprobs[:, 1:]``,
ids and scores as object columns) and ``RolloutScheduler.get_batch`` concatenates them.
The ``test_roll_reads_*`` tests do what ROLL's trainer code does with those fields
(``compute_discounted_returns``, GiGPO's state groups, reward normalisation,
``expand_to_token_level``, the ``[:, 1:]`` masks), re-implemented here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from compat.cases import pipeline_batch, rescored, trajectories, with_observations
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.data.proto import DataProto
from rollpipe.data.roll_layout import (
    ROLL_STEP_COLUMNS,
    ROLL_TENSORS,
    ROLL_TRAJECTORY_COLUMNS,
    native_infer_logprobs,
    roll_state_hash,
    to_roll,
)
from rollpipe.data.rows import step_rows, trajectory_rows
from rollpipe.grpo import group_advantages

from records import make_trajectory

PAD = 0
SETTINGS = settings(max_examples=40, deadline=None)
TENSOR_DTYPES = {
    "input_ids": torch.int64,
    "attention_mask": torch.int64,
    "position_ids": torch.int64,
    "response_mask": torch.bool,
    "prompt_mask": torch.bool,
    "scores": torch.float32,
    "infer_logprobs": torch.float32,
}


def _row(turns: list, score: float, pad_id: int, width: int) -> dict[str, torch.Tensor]:
    """One ROLL row: each history entry's prompt then response ids, masks and logprobs."""
    tokens: list[int] = []
    response: list[int] = []
    logprobs: list[float] = []
    for u in turns:
        tokens += [*u.prompt_ids, *u.response_ids]
        response += [0] * len(u.prompt_ids) + [1] * len(u.response_ids)
        logprobs += [0.0] * len(u.prompt_ids) + list(u.logprobs)
    n, pad = len(tokens), width - len(tokens)
    first = response.index(1)
    scores = [0.0] * width
    scores[n - 1] = score
    return {
        "input_ids": torch.tensor(tokens + [pad_id] * pad, dtype=torch.long),
        "attention_mask": torch.tensor([1] * n + [0] * pad, dtype=torch.long),
        "position_ids": torch.tensor(list(range(n)) + [0] * pad, dtype=torch.long),
        "response_mask": torch.tensor(response + [0] * pad, dtype=torch.bool),
        "prompt_mask": torch.tensor([1] * first + [0] * (width - first), dtype=torch.bool),
        "scores": torch.tensor(scores, dtype=torch.float),
        "infer_logprobs": torch.tensor(logprobs + [0.0] * pad, dtype=torch.float)[1:],
    }


def roll_rows(trajs: list, level: str, width: int, pad_id: int = PAD) -> dict[str, Any]:
    """ROLL's batch for ``trajs``, built from the records as its env managers build it."""
    rows, columns = [], []
    for t in trajs:
        rewards = [u.reward for u in t.turns]
        key = f"{t.tag}_{t.group_id}"
        ids = {
            "env_ids": t.env_id,
            "group_ids": t.group_id,
            "tags": t.tag,
            "traj_group_id": key,
            "traj_id": f"{key}_{t.episode_id}",
        }
        if level == "trajectory":
            rows.append(_row(list(t.turns), sum(rewards), pad_id, width))
            # ROLL stores np.array([rewards], dtype=object); its concat yields 1-D arrays
            columns.append(
                {
                    **ids,
                    "step_scores": np.array(rewards, dtype=object),
                    "episode_scores": sum(rewards),
                }
            )
            continue
        for i, u in enumerate(t.turns):
            rows.append(_row([u], u.reward, pad_id, width))
            columns.append(
                {
                    **ids,
                    "step_scores": u.reward,
                    "episode_scores": float(np.float32(t.score)),
                    "step": i,
                    "state_hash": roll_state_hash(u.observation),
                }
            )
    out: dict[str, Any] = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    for key in columns[0]:
        col = np.empty(len(columns), dtype=object)
        for i, c in enumerate(columns):
            col[i] = c[key]
        out[key] = col
    return out


def assert_roll_equal(got: DataProto, expected: dict[str, Any], level: str) -> None:
    names = ROLL_TRAJECTORY_COLUMNS if level == "trajectory" else ROLL_STEP_COLUMNS
    assert sorted(got.batch.keys()) == sorted(ROLL_TENSORS)
    assert sorted(got.non_tensor_batch) == sorted(names)
    for key in ROLL_TENSORS:
        value = got.batch[key]
        assert value.dtype == TENSOR_DTYPES[key], key
        assert value.shape == expected[key].shape, key
        assert torch.equal(value, expected[key]), key
    for key in names:
        col, want = got.non_tensor_batch[key], expected[key]
        assert col.dtype == object and col.ndim == 1, key
        for a, b in zip(col, want, strict=True):
            assert type(a) is type(b), (key, type(a), type(b))
            if isinstance(b, np.ndarray):
                assert b.dtype == a.dtype == object and a.tolist() == b.tolist(), key
            else:
                assert a == b, (key, a, b)


# ------------------------------------------------------------------ a real pipeline batch
@pytest.fixture(scope="module")
def trajectory_batch(vllm_engine: Any, tokenizer: Any) -> tuple[DataProto, list]:
    return pipeline_batch(vllm_engine, tokenizer)


@pytest.fixture(scope="module")
def step_batch(vllm_engine: Any, tokenizer: Any) -> tuple[DataProto, list]:
    batch, trajs = pipeline_batch(vllm_engine, tokenizer, level="step", history_window=2)
    return with_observations(batch, trajs), trajs


def test_trajectory_rows_are_rolls_traj_env_manager_rows(trajectory_batch):
    batch, trajs = trajectory_batch
    width = batch.batch["input_ids"].shape[1]
    assert max(t.num_turns for t in trajs) > 1  # multi-turn rows, observations in between
    assert_roll_equal(to_roll(batch), roll_rows(trajs, "trajectory", width), "trajectory")
    # ROLL pads to its fixed sequence_length; infer_logprobs is one shorter
    fixed = to_roll(batch, sequence_length=width + 37)
    assert fixed.batch["input_ids"].shape == (len(batch), width + 37)
    assert fixed.batch["infer_logprobs"].shape == (len(batch), width + 36)
    assert_roll_equal(fixed, roll_rows(trajs, "trajectory", width + 37), "trajectory")
    assert fixed.meta_info == batch.meta_info


def test_step_rows_are_rolls_step_env_manager_rows(step_batch):
    batch, trajs = step_batch
    width = batch.batch["input_ids"].shape[1]
    assert_roll_equal(batch.to_roll(), roll_rows(trajs, "step", width), "step")


def test_step_rows_need_the_observations_column(step_batch):
    bare = step_batch[0].clone()
    bare.pop(non_tensor_batch_keys=["observations"])
    with pytest.raises(KeyError, match="'observations' column"):
        to_roll(bare)


def test_state_hash_is_rolls_sha256_of_the_observation():
    # values of ROLL's compute_object_hash (roll/utils/hash_utils.py), run on these strings
    assert roll_state_hash("") == (
        "54ea5529a8e15d265ee1b71445cbd1be3b18679ce0d1ad87fc75154a099bf2b1"
    )
    assert roll_state_hash("FFFG\nFHFH") == (
        "f0d28acbb38ce54ced0fc17d0905522c233d7e3d0ac7c65b82ce80739c8f495e"
    )
    assert roll_state_hash("café ☃") == (
        "ca45aa95b80aaa5dfd8022ba8a761067999d9c744800878f6f743bf30e9f309a"
    )


def test_group_ids_and_string_ids_group_as_the_native_ids(trajectory_batch, step_batch):
    for batch, _ in (trajectory_batch, step_batch):
        roll = to_roll(batch)
        native_groups = batch.batch["traj_group_id"].tolist()
        native_trajs = batch.batch["traj_id"].tolist()
        assert roll.non_tensor_batch["group_ids"].tolist() == native_groups
        for i in range(len(batch)):
            for j in range(len(batch)):
                same_group = roll["traj_group_id"][i] == roll["traj_group_id"][j]
                same_traj = roll["traj_id"][i] == roll["traj_id"][j]
                assert same_group == (native_groups[i] == native_groups[j])
                assert same_traj == (native_trajs[i] == native_trajs[j])


# ------------------------------------------------------------------ what ROLL's trainer reads
def test_roll_reads_discounted_returns_per_trajectory(step_batch):
    """``compute_discounted_returns``: group by ``traj_id``, order by ``step``, returns of
    ``step_scores`` (gamma 1: the first step's return is the episode score)."""
    roll = to_roll(step_batch[0])
    for traj in roll.group_by("traj_id").values():
        steps = traj.non_tensor_batch["step"].astype(np.int64)
        order = np.argsort(steps)
        assert steps[order].tolist() == list(range(len(traj)))
        rewards = torch.as_tensor(traj.non_tensor_batch["step_scores"].astype(np.float32))
        returns = rewards[torch.as_tensor(order)].flip(0).cumsum(0).flip(0)
        episode = traj.non_tensor_batch["episode_scores"].astype(np.float32)
        assert torch.allclose(returns[0], torch.tensor(float(episode[0])), atol=1e-5)


def test_roll_reads_gigpo_state_groups(step_batch):
    """GiGPO's ``build_state_group``: within a ``traj_group_id``, rows with one
    ``state_hash`` answered one observation, and the state groups are the native ones."""
    batch, _ = step_batch
    roll = to_roll(batch, extras=True)  # keeps the observations, to look at
    for group in roll.group_by("traj_group_id").values():
        for state in group.group_by("state_hash").values():
            assert len(set(state["observations"].tolist())) == 1
    roll_keys = list(zip(roll["traj_group_id"], roll["state_hash"], strict=True))
    native = batch.batch["state_hash"].tolist()
    pairs = set(zip(roll_keys, native, strict=True))
    assert len(pairs) == len(set(roll_keys)) == len(set(native))


def test_roll_reads_group_normalised_rewards(trajectory_batch):
    """Reward normalisation grouped by ``traj_group_id`` (mean and std of each group's
    ``scores.sum(-1)``) gives rollpipe's GRPO advantages."""
    batch = rescored(trajectory_batch[0])
    roll = to_roll(batch)
    normalised = torch.zeros(len(roll))
    for key in set(roll["traj_group_id"].tolist()):
        rows = torch.as_tensor(np.flatnonzero(roll["traj_group_id"] == key))
        scores = roll.batch["scores"][rows].sum(-1)
        std = scores.std()
        normalised[rows] = (scores - scores.mean()) / (std + 1e-6) if std > 1e-6 else 0.0
    expected = group_advantages(batch.batch["scores"].sum(-1), batch.batch["traj_group_id"])
    assert expected.abs().max() > 0.5  # the groups' scores differ
    assert torch.allclose(normalised, expected, atol=1e-5)


def test_roll_reads_token_level_positions_and_shifted_masks(trajectory_batch, step_batch):
    """``expand_to_token_level`` puts the reward at ``argmax(position_ids * attention_mask)``
    (the last token, where ``scores`` is); the loss reads ``response_mask[:, 1:]`` and
    ``infer_logprobs`` with one shape; ``episode_scores`` become a float tensor."""
    for batch, _ in (trajectory_batch, step_batch):
        roll = to_roll(batch, sequence_length=batch.batch["input_ids"].shape[1] + 5)
        td = roll.batch
        last = torch.argmax(td["position_ids"] * td["attention_mask"], dim=-1)
        assert torch.equal(last, td["attention_mask"].sum(-1) - 1)
        rows = torch.arange(len(roll))
        assert torch.equal(td["scores"][rows, last], td["scores"].sum(-1))
        assert td["response_mask"][:, 1:].shape == td["infer_logprobs"].shape
        assert not (td["infer_logprobs"] * ~td["response_mask"][:, 1:]).any()
        scores = torch.tensor(
            [float(g["episode_scores"][0]) for g in roll.group_by("traj_id").values()]
        )
        assert scores.dtype == torch.float32


# ------------------------------------------------------------------ properties
@SETTINGS
@given(
    trajectories(),
    st.sampled_from(["right", "left"]),
    st.sampled_from([None, 8]),
)
def test_trajectory_rows_to_roll_for_any_records(trajs, side, multiple):
    native = trajectory_rows(trajs, PAD, padding_side=side, pad_to_multiple_of=multiple)
    width = native.batch["input_ids"].shape[1]
    roll = to_roll(native)
    assert_roll_equal(roll, roll_rows(trajs, "trajectory", width), "trajectory")
    # lossless on what it keeps: un-shifting recovers the native per-token logprobs
    right = to_roll(trajectory_rows(trajs, PAD, pad_to_multiple_of=multiple))
    assert right.equals(roll)  # the native padding side does not matter
    natively_right = trajectory_rows(trajs, PAD, pad_to_multiple_of=multiple)
    unshifted = native_infer_logprobs(roll.batch["infer_logprobs"])
    assert torch.equal(unshifted, natively_right.batch["infer_logprobs"])
    for key in ("input_ids", "attention_mask", "response_mask", "prompt_mask", "scores"):
        assert torch.equal(roll.batch[key], natively_right.batch[key]), key


@SETTINGS
@given(trajectories(windowed=True), st.sampled_from(["right", "left"]), st.integers(0, 9))
def test_step_rows_to_roll_for_any_records(trajs, side, extra):
    native = with_observations(step_rows(trajs, PAD, padding_side=side), trajs)
    width = native.batch["input_ids"].shape[1] + extra
    roll = to_roll(native, sequence_length=width, pad_token_id=PAD)
    assert_roll_equal(roll, roll_rows(trajs, "step", width), "step")
    unshifted = native_infer_logprobs(roll.batch["infer_logprobs"])
    mask = roll.batch["response_mask"]
    assert torch.equal(
        unshifted[mask], native.batch["infer_logprobs"][native.batch["response_mask"]]
    )


@SETTINGS
@given(trajectories())
def test_extras_keep_rollpipe_columns(trajs):
    native = trajectory_rows(trajs, PAD, padding_side="left")
    roll = to_roll(native, extras=True)
    for key in ("uid", "traj_uid", "end_reasons"):
        assert roll[key].tolist() == native[key].tolist()
    versions = roll.batch["policy_versions"]
    mask = roll.batch["response_mask"]
    assert torch.equal(
        versions[mask], native.batch["policy_versions"][native.batch["response_mask"]]
    )
    assert (versions[~mask] == -1).all()
    assert "policy_versions" not in to_roll(native)


def test_padding_needs_a_pad_id_or_room():
    native = trajectory_rows([make_trajectory(0, 0)], PAD)  # no padding to read the id from
    width = native.batch["input_ids"].shape[1]
    with pytest.raises(ValueError, match="pass pad_token_id"):
        to_roll(native, sequence_length=width + 2)
    padded = to_roll(native, sequence_length=width + 2, pad_token_id=99)
    assert (padded.batch["input_ids"][:, width:] == 99).all()
    with pytest.raises(ValueError, match="shorter than the longest row"):
        to_roll(native, sequence_length=width - 1)
    with pytest.raises(KeyError, match="infer_logprobs"):
        to_roll(native.select(batch_keys=["input_ids", "attention_mask"]))


def test_the_pipeline_yields_rolls_layout_when_asked(vllm_engine, tokenizer):
    """``PipelineConfig(layout="roll")`` converts every batch with ``to_roll()``."""
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline

    config = PipelineConfig(
        group_size=4, batch_size=8, max_turns=2, sampling={"max_tokens": 16}, layout="roll"
    )
    with RolloutPipeline(config, vllm_engine, tokenizer) as pipe:
        batch = pipe.get_batch()
    assert batch.batch["infer_logprobs"].shape[1] == batch.batch["input_ids"].shape[1] - 1
    assert isinstance(batch.non_tensor_batch["traj_group_id"][0], str)
    assert "traj_group_id" not in batch.batch
