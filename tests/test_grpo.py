"""GRPO helpers: advantages are centred per group, loss only sees response tokens."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.data.proto import DataProto
from rollpipe.grpo import group_advantages, policy_loss, turn_advantages


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-5, 5)), min_size=1, max_size=40))
def test_advantages_are_centred_and_scaled_per_group(rows):
    group_ids = torch.tensor([g for g, _ in rows])
    scores = torch.tensor([s for _, s in rows], dtype=torch.float32)
    adv = group_advantages(scores, group_ids)
    for g in group_ids.unique():
        members = adv[group_ids == g].double()
        if len(members) == 1:
            assert members.item() == 0.0
            continue
        assert abs(members.mean().item()) < 1e-4
        raw = scores[group_ids == g].double()
        if raw.std() > 1e-3:
            assert abs(members.std().item() - 1.0) < 1e-2


def test_loss_ignores_non_response_tokens():
    batch = DataProto.from_dict(
        tensors={
            "response_mask": torch.tensor([[0, 1, 1, 0]]),
            "infer_logprobs": torch.tensor([[0.0, -1.0, -1.0, 0.0]]),
        }
    )
    logprobs = torch.tensor([[-9.0, -1.0, -1.0, -9.0]], requires_grad=True)
    loss = policy_loss(logprobs, batch, torch.tensor([2.0]))
    loss.backward()
    assert torch.isclose(loss, torch.tensor(-2.0))  # ratio 1 on the two response tokens
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 3] == 0
    assert (logprobs.grad[0, 1:3] != 0).all()


def _rows(tokens: list[list[int]], response: list[list[int]], groups, scores) -> DataProto:
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.tensor(tokens),
            "response_mask": torch.tensor(response).bool(),
            "traj_group_id": torch.tensor(groups),
            "episode_scores": torch.tensor(scores, dtype=torch.float32),
        }
    )


def test_turn_advantages_compare_turns_from_the_same_observation():
    # three members of one group: the same first prompt (5, 6); the first two then see
    # the same feedback (7), the third another (8), after which it is alone
    tokens = [[5, 6, 1, 7, 2, 0], [5, 6, 1, 7, 3, 0], [5, 6, 4, 8, 2, 0]]
    response = [[0, 0, 1, 0, 1, 0]] * 3
    batch = _rows(tokens, response, [0, 0, 0], [1.0, 0.0, 1.0])
    adv = turn_advantages(batch, scale=False)
    first = adv[:, 2]  # every member saw (5, 6): centred on the group, as GRPO
    assert torch.allclose(first, torch.tensor([1 / 3, -2 / 3, 1 / 3]))
    assert torch.allclose(adv[:2, 4], torch.tensor([0.5, -0.5]))  # both saw (7)
    assert adv[2, 4] == 0  # alone after (8)
    assert (adv[~batch.batch["response_mask"]] == 0).all()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2), min_size=1, max_size=4)),
        min_size=1,
        max_size=12,
    ),
    st.randoms(use_true_random=False),
)
def test_turn_advantages_are_centred_in_every_step_group(episodes, rng):
    """Any rows: each step group's advantages sum to 0, tokens outside answers get 0."""
    width = 2 * 4 + 1
    tokens, response, groups, scores = [], [], [], []
    for group, observations in episodes:
        row, mask = [], []
        for obs in observations:
            row += [10 + obs, 1]
            mask += [0, 1]
        tokens.append(row + [0] * (width - len(row)))
        response.append(mask + [0] * (width - len(mask)))
        groups.append(group)
        scores.append(float(rng.randint(0, 3)))
    batch = _rows(tokens, response, groups, scores)
    adv = turn_advantages(batch)
    mask = batch.batch["response_mask"]
    assert (adv[~mask] == 0).all()
    sums: dict[tuple, float] = {}
    for row, (group, observations) in enumerate(episodes):
        for turn in range(len(observations)):
            key = (group, observations[turn])
            sums[key] = sums.get(key, 0.0) + float(adv[row, 2 * turn + 1])
    assert all(abs(total) < 1e-3 for total in sums.values())
