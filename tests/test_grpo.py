"""GRPO helpers: advantages are centred per group, loss only sees response tokens."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.data.proto import DataProto
from rollpipe.grpo import group_advantages, policy_loss


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
