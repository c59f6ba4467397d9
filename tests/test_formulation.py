"""Formulation: trajectories -> padded rows, checked as properties on synthetic records.

Token content is synthetic here (the rows must hold for *any* ids); rows built from
real engine and tokenizer output are checked in test_episode.py.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
from rollpipe.data.padding import position_ids_from_mask, unpad_rows
from rollpipe.data.proto import DataProto
from rollpipe.data.rows import state_hash, step_rows, trajectory_rows

PAD = 0


@st.composite
def turns_st(draw: st.DrawFn, windowed: bool) -> Turn:
    prompt = draw(st.lists(st.integers(1, 500), min_size=1, max_size=8))
    n = draw(st.integers(0, 6))
    return Turn(
        prompt_ids=prompt,
        response_ids=draw(st.lists(st.integers(1, 500), min_size=n, max_size=n)),
        logprobs=draw(st.lists(st.floats(-20, 0, width=32), min_size=n, max_size=n)),
        versions=draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)),
        reward=draw(st.sampled_from([-0.1, 0.0, 1.0])),
        finish_reason=draw(st.sampled_from(["stop", "length"])),
        action_valid=draw(st.booleans()),
        action_text="a",
        observation=draw(st.sampled_from(["s0", "s1", "s2"])),
    )


@st.composite
def trajs_st(draw: st.DrawFn, windowed: bool = False) -> list[Trajectory]:
    out = []
    for i in range(draw(st.integers(1, 4))):
        turns = tuple(draw(st.lists(turns_st(windowed), min_size=1, max_size=4)))
        out.append(
            Trajectory(
                spec=EpisodeSpec(group_id=i // 2, episode_id=i, seed=5, tag=f"t{i % 2}"),
                env_id=10 + i,
                turns=turns,
                score=sum(t.reward for t in turns),
                success=False,
                end_reason=draw(st.sampled_from(["terminated", "max_turns", "max_length"])),
                history_window=2 if windowed else None,
            )
        )
    return out


def expected_rows(t: Trajectory) -> list[int]:
    return [x for u in t.turns for x in (*u.prompt_ids, *u.response_ids)]


def check_common(dp: DataProto) -> None:
    b = dp.batch
    am = b["attention_mask"]
    assert torch.equal(b["position_ids"], position_ids_from_mask(am))
    assert not (b["response_mask"] & (am == 0)).any()  # response within attention
    assert not (b["prompt_mask"] & (am == 0)).any()
    # prompt_mask: exactly the real tokens before the first response token of each row
    first = torch.where(
        b["response_mask"].any(-1), b["response_mask"].int().argmax(-1), am.shape[1]
    )
    cols = torch.arange(am.shape[1]).unsqueeze(0)
    assert torch.equal(b["prompt_mask"], (cols < first.unsqueeze(1)) & (am == 1))
    # per-token fields are zero / -1 exactly off the generated tokens
    assert (b["infer_logprobs"][~b["response_mask"]] == 0).all()
    assert (b["policy_versions"][~b["response_mask"]] == -1).all()
    assert (b["policy_versions"][b["response_mask"]] >= 0).all()
    # the score sits on the last real token
    last = am.cumsum(-1).argmax(-1)
    assert torch.equal(b["scores"].sum(-1), b["scores"][torch.arange(len(dp)), last])
    assert (b["input_ids"][am == 0] == PAD).all()
    assert b["response_mask"].dtype == torch.bool and b["scores"].dtype == torch.float32


@settings(max_examples=25, deadline=None)
@given(trajs_st(), st.sampled_from(["right", "left"]), st.sampled_from([None, 8]))
def test_trajectory_rows_are_exact_concatenations(
    trajs: list[Trajectory], side: str, multiple: int | None
) -> None:
    dp = trajectory_rows(trajs, PAD, padding_side=side, pad_to_multiple_of=multiple)  # type: ignore[arg-type]
    assert len(dp) == len(trajs)
    b = dp.batch
    check_common(dp)
    if multiple:
        assert b["input_ids"].shape[1] % multiple == 0
    assert b["input_ids"].shape[1] == max(
        -(-len(expected_rows(t)) // (multiple or 1)) * (multiple or 1) for t in trajs
    )
    rows = unpad_rows(b["input_ids"], b["attention_mask"])
    resp = unpad_rows(b["response_mask"], b["attention_mask"])
    lps = unpad_rows(b["infer_logprobs"], b["attention_mask"])
    vers = unpad_rows(b["policy_versions"], b["attention_mask"])
    for i, t in enumerate(trajs):
        assert rows[i].tolist() == expected_rows(t)
        flags = [f for u in t.turns for f in [0] * len(u.prompt_ids) + [1] * len(u.response_ids)]
        assert resp[i].int().tolist() == flags
        gen = [x for u in t.turns for x in u.logprobs]
        assert lps[i][resp[i]].tolist() == pytest.approx(gen)
        assert vers[i][resp[i]].tolist() == [x for u in t.turns for x in u.versions]
        # prompt_mask covers the first prompt, at least (more when the first response is empty)
        assert b["prompt_mask"][i].sum() >= len(t.turns[0].prompt_ids)
    assert b["scores"].sum(-1).tolist() == pytest.approx([t.score for t in trajs])
    assert b["episode_scores"].tolist() == pytest.approx([t.score for t in trajs])
    assert b["traj_group_id"].tolist() == [t.group_id for t in trajs]
    assert b["traj_id"].tolist() == [t.episode_id for t in trajs]
    assert b["env_ids"].tolist() == [t.env_id for t in trajs]
    assert b["traj_id"].dtype == b["env_ids"].dtype == torch.int64
    nt = dp.non_tensor_batch
    assert list(nt["step_scores"]) == [t.step_scores for t in trajs]
    assert list(nt["tags"]) == [t.tag for t in trajs]
    assert list(nt["end_reasons"]) == [t.end_reason for t in trajs]
    assert list(nt["uid"]) == [t.group_uid for t in trajs]
    assert list(nt["traj_uid"]) == [t.traj_id for t in trajs]
    assert all(a.ndim == 1 and a.dtype == object for a in nt.values())


@settings(max_examples=25, deadline=None)
@given(st.booleans().flatmap(lambda w: st.tuples(st.just(w), trajs_st(windowed=w))))
def test_step_rows_rebuild_each_engine_request(case: tuple[bool, list[Trajectory]]) -> None:
    windowed, trajs = case
    dp = step_rows(trajs, PAD)
    check_common(dp)
    b = dp.batch
    assert len(dp) == sum(len(t.turns) for t in trajs)
    rows = unpad_rows(b["input_ids"], b["attention_mask"])
    resp = unpad_rows(b["response_mask"], b["attention_mask"])
    r = 0
    for t in trajs:
        for i, u in enumerate(t.turns):
            context = [] if windowed else expected_rows(_prefix(t, i))
            assert rows[r].tolist() == [*context, *u.prompt_ids, *u.response_ids]
            assert resp[r].sum() == len(u.response_ids)
            assert rows[r][resp[r]].tolist() == list(u.response_ids)
            assert b["step"][r] == i
            assert b["state_hash"][r] == state_hash(t.group_id, u.observation)
            assert b["scores"][r].sum().item() == pytest.approx(u.reward)
            assert b["episode_scores"][r].item() == pytest.approx(t.score)
            assert b["traj_id"][r] == t.episode_id and b["traj_group_id"][r] == t.group_id
            assert dp.non_tensor_batch["step_scores"][r] == u.reward
            assert dp.non_tensor_batch["traj_uid"][r] == t.traj_id
            r += 1


def _prefix(t: Trajectory, i: int) -> Trajectory:
    return attrs.evolve(t, turns=t.turns[:i])


def test_state_hash_is_stable_int64_and_namespaced_by_group() -> None:
    h = state_hash(3, "grid")
    assert h == state_hash(3, "grid") and -(2**63) <= h < 2**63
    assert h != state_hash(4, "grid") and h != state_hash(3, "grid2")
    assert h == 2935320711577957161  # the same in every process and on every run


def test_rows_reject_empty_and_windowed_inputs() -> None:
    t = Trajectory(EpisodeSpec(0, 1, 2), 0, (), 0.0, False, "max_length")
    with pytest.raises(ValueError, match=r"have no turns .*max_length"):
        trajectory_rows([t], PAD)
    with pytest.raises(ValueError, match="at least one trajectory"):
        step_rows([], PAD)
    u = Turn([1], [2], [0.0], [0], 0.0, "stop", True, "a", "o")
    w = Trajectory(EpisodeSpec(0, 1, 2), 0, (u,), 0.0, False, "max_turns", history_window=1)
    with pytest.raises(ValueError, match="use step_rows"):
        trajectory_rows([w], PAD)
    assert len(step_rows([w], PAD)) == 1


def test_thousands_of_trajectories_make_whole_rows() -> None:
    """At scale, every row has the shape its turns give. How fast formulation is, is
    bench/collate.py's figure (``collate_vs_memcpy``), never a test's assertion."""
    g = torch.Generator().manual_seed(0)

    def one(i: int) -> Trajectory:
        turns = tuple(
            Turn(
                prompt_ids=torch.randint(1, 500, (40 if k == 0 else 12,), generator=g).tolist(),
                response_ids=torch.randint(1, 500, (30,), generator=g).tolist(),
                logprobs=[-1.0] * 30,
                versions=[1] * 30,
                reward=0.0,
                finish_reason="stop",
                action_valid=True,
                action_text="a",
                observation=f"s{k}",
            )
            for k in range(5)
        )
        return Trajectory(EpisodeSpec(i // 8, i, 1), i % 16, turns, 1.0, True, "terminated")

    trajs = [one(i) for i in range(2000)]
    dp = trajectory_rows(trajs, PAD)
    steps = step_rows(trajs[:400], PAD)
    assert len(dp) == 2000 and dp.batch["input_ids"].shape == (2000, 40 + 4 * 12 + 5 * 30)
    assert len(steps) == 2000
    alone = trajectory_rows(trajs[-3:], PAD).batch  # the same length: no padding differs
    keys = list(alone.keys())  # iterating a TensorDict gives rows, not keys
    assert keys and all(torch.equal(alone[key], dp.batch[key][-3:]) for key in keys)


def test_a_new_row_turn_starts_a_row_of_its_own() -> None:
    """Turn.new_row (an agent that rewrote its history): trajectory rows split there,
    each row the exact ids of its segment; a step row's context starts at its segment."""

    def turn(prompt: list[int], response: list[int], new_row: bool = False) -> Turn:
        n = len(response)
        return Turn(prompt, response, [-0.5] * n, [3] * n, 0.0, "stop", True, "a", "o",
                    new_row=new_row)  # fmt: skip

    turns = (turn([1, 2], [3]), turn([4], [5, 6]), turn([7, 8, 9], [10], True), turn([11], [12]))
    t = Trajectory(EpisodeSpec(0, 1, 2), 0, turns, 2.0, True, "terminated")
    rows = trajectory_rows([t], PAD)
    assert len(rows) == 2
    real = [
        rows.batch["input_ids"][i][rows.batch["attention_mask"][i].bool()].tolist() for i in (0, 1)
    ]
    assert real == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    assert rows.batch["response_mask"].sum(dim=1).tolist() == [3, 2]
    assert rows.batch["episode_scores"].tolist() == [2.0, 2.0]
    assert list(rows.non_tensor_batch["traj_uid"]) == [t.traj_id] * 2
    steps = step_rows([t], PAD)
    contexts = [
        steps.batch["input_ids"][i][steps.batch["attention_mask"][i].bool()].tolist()
        for i in range(4)
    ]
    assert contexts == [[1, 2, 3], [1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [7, 8, 9, 10, 11, 12]]
    assert Turn.from_state(turns[2].to_state()).new_row
