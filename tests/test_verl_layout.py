"""``verl_parts`` / ``to_verl``: native rows as verl's agent loop batch, without verl.

The reference, ``agent_loop_rows``, re-derives verl's batch from the trajectory records
the way verl's ``AgentLoopOutput`` and ``AgentLoopWorker`` build one: ``prompt_ids`` the
first prompt, ``response_ids`` every later token (responses and the observations between
them), ``response_mask`` 1 on generated tokens, ``response_logprobs`` 0 off them, the
prompt left-padded and the response right-padded, ``rm_scores`` the reward on the last
response token. verl's own functions run on these batches in ``tests/compat``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch
from compat.cases import pipeline_batch, trajectories
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.data.proto import DataProto
from rollpipe.data.rows import step_rows, trajectory_rows
from rollpipe.data.verl_layout import VERL_EXTRA_COLUMNS, VERL_TENSORS, to_verl, verl_parts

PAD = 0
SETTINGS = settings(max_examples=40, deadline=None)


def _output(segments: list, score: float) -> dict[str, Any]:
    """One ``AgentLoopOutput``: the first segment's prompt, then everything else."""
    first = segments[0]
    response: list[int] = list(first.response_ids)
    mask = [1] * len(first.response_ids)
    logprobs = list(first.logprobs)
    versions = list(first.versions)
    for u in segments[1:]:
        response += [*u.prompt_ids, *u.response_ids]
        mask += [0] * len(u.prompt_ids) + [1] * len(u.response_ids)
        logprobs += [0.0] * len(u.prompt_ids) + list(u.logprobs)
        versions += list(u.versions)
    return {
        "prompt_ids": list(first.prompt_ids),
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": logprobs,
        "reward_score": score,
        "versions": versions,
    }


def agent_loop_rows(trajs: list, level: str, p_len: int, r_len: int) -> dict[str, Any]:
    """verl's agent-loop tensors for ``trajs``, padded to ``p_len`` / ``r_len``."""
    outputs = []
    for t in trajs:
        if level == "trajectory":
            outputs.append(_output(list(t.turns), t.score))
        else:
            outputs += [_output([u], u.reward) for u in t.turns]
    rows: dict[str, list] = {k: [] for k in VERL_TENSORS}
    for o in outputs:
        p_pad, r_pad = p_len - len(o["prompt_ids"]), r_len - len(o["response_ids"])
        prompts = [PAD] * p_pad + o["prompt_ids"]
        responses = o["response_ids"] + [PAD] * r_pad
        attention = [0] * p_pad + [1] * (len(o["prompt_ids"]) + len(o["response_ids"]))
        attention += [0] * r_pad
        rm = [0.0] * r_len
        rm[len(o["response_ids"]) - 1] = o["reward_score"]
        rows["prompts"].append(prompts)
        rows["responses"].append(responses)
        rows["response_mask"].append(o["response_mask"] + [0] * r_pad)
        rows["input_ids"].append(prompts + responses)
        rows["attention_mask"].append(attention)
        rows["position_ids"].append(np.clip(np.cumsum(attention) - 1, 0, None).tolist())
        rows["rollout_log_probs"].append(o["response_logprobs"] + [0.0] * r_pad)
        rows["rm_scores"].append(rm)
    floats = ("rollout_log_probs", "rm_scores")
    return {
        k: torch.tensor(v, dtype=torch.float32 if k in floats else torch.int64)
        for k, v in rows.items()
    }


def widths(trajs: list, level: str) -> tuple[int, int]:
    if level == "step":
        pairs = [(len(u.prompt_ids), len(u.response_ids)) for t in trajs for u in t.turns]
    else:
        pairs = [
            (len(t.turns[0].prompt_ids), sum(len(u.token_array) for u in t.turns)) for t in trajs
        ]
        pairs = [(p, n - p) for p, n in pairs]
    return max(p for p, _ in pairs), max(r for _, r in pairs)


def assert_like_agent_loop(tensors: dict, expected: dict) -> None:
    for key in VERL_TENSORS:
        assert tensors[key].dtype == expected[key].dtype, key
        assert tensors[key].shape == expected[key].shape, key
        assert torch.equal(tensors[key], expected[key]), key


@pytest.fixture(scope="module")
def trajectory_batch(vllm_engine: Any, tokenizer: Any) -> tuple[DataProto, list]:
    return pipeline_batch(vllm_engine, tokenizer)


def test_trajectory_rows_are_the_agent_loops_batch(trajectory_batch):
    batch, trajs = trajectory_batch
    tensors, columns, meta = verl_parts(batch)
    p_len, r_len = widths(trajs, "trajectory")
    assert_like_agent_loop(tensors, agent_loop_rows(trajs, "trajectory", p_len, r_len))
    # multi-turn: observation tokens inside `responses` are attended but not trained on
    inside = tensors["attention_mask"][:, p_len:].bool() & ~tensors["response_mask"].bool()
    assert inside.any()
    # the columns GRPO and verl's metrics read
    assert columns["uid"].tolist() == batch["uid"].tolist()
    assert columns["__num_turns__"].dtype == np.int32
    assert columns["__num_turns__"].tolist() == [2 * t.num_turns for t in trajs]
    assert columns["turn_scores"].tolist() == [t.step_scores for t in trajs]
    assert columns["min_global_steps"].tolist() == [t.min_version for t in trajs]
    assert columns["max_global_steps"].tolist() == [t.max_version for t in trajs]
    for key in VERL_EXTRA_COLUMNS:
        assert columns[key].dtype == object and columns[key].shape == (len(batch),)
    assert meta["timing"] == {} and meta["reward_extra_keys"] == []
    assert meta["metrics"] == batch.meta_info["metrics"]
    # per-row ids stay; per-token native fields are response-side
    assert torch.equal(tensors["traj_group_id"], batch.batch["traj_group_id"])
    assert tensors["policy_versions"].shape == (len(batch), r_len)


def test_step_rows_are_one_agent_loop_row_per_turn(vllm_engine, tokenizer):
    batch, trajs = pipeline_batch(vllm_engine, tokenizer, level="step", history_window=2)
    p_len, r_len = widths(trajs, "step")
    tensors, columns, _ = verl_parts(batch, prompt_length=p_len + 3, response_length=r_len + 2)
    assert_like_agent_loop(tensors, agent_loop_rows(trajs, "step", p_len + 3, r_len + 2))
    assert (columns["__num_turns__"] == 2).all()
    assert torch.equal(tensors["step"], batch.batch["step"])


@SETTINGS
@given(
    trajectories(),
    st.sampled_from(["right", "left"]),
    st.integers(0, 4),
    st.integers(0, 4),
)
def test_trajectory_rows_for_any_records(trajs, side, more_prompt, more_response):
    native = trajectory_rows(trajs, PAD, padding_side=side, pad_to_multiple_of=4)
    p_len, r_len = widths(trajs, "trajectory")
    p_len, r_len = p_len + more_prompt, r_len + more_response
    tensors, columns, _ = verl_parts(native, prompt_length=p_len, response_length=r_len)
    assert_like_agent_loop(tensors, agent_loop_rows(trajs, "trajectory", p_len, r_len))
    assert columns["uid"].tolist() == [t.group_uid for t in trajs]


@SETTINGS
@given(trajectories(windowed=True), st.sampled_from(["right", "left"]))
def test_step_rows_for_any_records(trajs, side):
    native = step_rows(trajs, PAD, padding_side=side)
    p_len, r_len = widths(trajs, "step")
    tensors, columns, _ = verl_parts(native)
    assert_like_agent_loop(tensors, agent_loop_rows(trajs, "step", p_len, r_len))
    assert columns["turn_scores"].tolist() == [[u.reward] for t in trajs for u in t.turns]


def test_lengths_shorter_than_the_batch_are_an_error(trajectory_batch):
    batch, trajs = trajectory_batch
    p_len, r_len = widths(trajs, "trajectory")
    with pytest.raises(ValueError, match="prompt_length"):
        verl_parts(batch, prompt_length=p_len - 1)
    with pytest.raises(ValueError, match="response_length"):
        verl_parts(batch, response_length=r_len - 1)
    with pytest.raises(KeyError, match="policy_versions"):
        verl_parts(batch.select(batch_keys=["input_ids", "attention_mask"]))


def test_to_verl_without_verl_names_what_to_install(trajectory_batch, monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)
    monkeypatch.setitem(sys.modules, "verl.protocol", None)
    with pytest.raises(ImportError, match=r"rollpipe\[compat\]"):
        to_verl(trajectory_batch[0])
    with pytest.raises(ImportError, match="pip install verl"):
        trajectory_batch[0].to_verl()
