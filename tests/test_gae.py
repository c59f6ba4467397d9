"""GAE: equality with a plain-Python loop, truncation bootstrap, attaching to rollouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.training.gae import compute_gae, gae
from rollpipe.training.ppo_buffer import RolloutBuffer, transition_view


def reference_gae(
    reward: list[float],
    value: list[float],
    next_value: list[float],
    terminated: list[bool],
    truncated: list[bool],
    final_value: list[float] | None,
    gamma: float,
    lam: float,
) -> tuple[list[float], list[float]]:
    """Textbook GAE for one environment, one step at a time, in plain Python."""
    T = len(reward)
    adv = [0.0] * T
    running = 0.0
    for t in reversed(range(T)):
        if terminated[t]:
            bootstrap, carry = 0.0, 0.0
        elif truncated[t]:
            bootstrap, carry = (final_value[t] if final_value is not None else 0.0), 0.0
        else:
            bootstrap, carry = next_value[t], 1.0
        delta = reward[t] + gamma * bootstrap - value[t]
        running = delta + gamma * lam * carry * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, value, strict=True)]


floats = st.floats(-10, 10, allow_nan=False, width=32)


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 4),
    t=st.integers(1, 12),
    gamma=st.floats(0, 1),
    lam=st.floats(0, 1),
    with_final=st.booleans(),
    data=st.data(),
)
def test_gae_matches_plain_python_reference(
    n: int, t: int, gamma: float, lam: float, with_final: bool, data: st.DataObject
) -> None:
    def tensor(elems: st.SearchStrategy, dtype: torch.dtype) -> torch.Tensor:
        rows = data.draw(st.lists(st.lists(elems, min_size=t, max_size=t), min_size=n, max_size=n))
        return torch.tensor(rows, dtype=dtype)

    reward, value, next_value = (tensor(floats, torch.float32) for _ in range(3))
    terminated = tensor(st.booleans(), torch.bool)
    truncated = tensor(st.booleans(), torch.bool)
    final_value = tensor(floats, torch.float32) if with_final else None
    adv, ret = gae(
        reward,
        value,
        next_value,
        terminated | truncated,
        gamma=gamma,
        lam=lam,
        terminated=terminated,
        final_value=final_value,
    )
    for i in range(n):
        ref_adv, ref_ret = reference_gae(
            reward[i].tolist(),
            value[i].tolist(),
            next_value[i].tolist(),
            terminated[i].tolist(),
            truncated[i].tolist(),
            None if final_value is None else final_value[i].tolist(),
            gamma,
            lam,
        )
        assert adv[i].tolist() == pytest.approx(ref_adv, rel=1e-4, abs=1e-3)
        assert ret[i].tolist() == pytest.approx(ref_ret, rel=1e-4, abs=1e-3)


def test_undiscounted_gae_without_dones_is_reward_to_go_plus_bootstrap() -> None:
    reward = torch.tensor([[1.0, 2.0, 3.0]])
    value = torch.tensor([[0.5, 0.25, 0.125]])
    next_value = torch.tensor([[0.25, 0.125, 10.0]])
    done = torch.zeros(1, 3, dtype=torch.bool)
    adv, ret = gae(reward, value, next_value, done, gamma=1.0, lam=1.0)
    assert ret.tolist() == [[16.0, 15.0, 13.0]]
    assert adv.tolist() == [[15.5, 14.75, 12.875]]


def test_truncation_bootstraps_from_final_value_and_termination_does_not() -> None:
    reward = torch.ones(3, 1)
    value = torch.zeros(3, 1)
    next_value = torch.full((3, 1), 100.0)  # the reset obs: never used after an episode end
    terminated = torch.tensor([[True], [False], [True]])
    truncated = torch.tensor([[False], [True], [True]])
    final_value = torch.full((3, 1), 10.0)
    done = terminated | truncated
    adv, _ = gae(
        reward, value, next_value, done, gamma=0.5, lam=1.0, terminated=terminated,
        final_value=final_value,
    )  # fmt: skip
    assert adv[:, 0].tolist() == [1.0, 6.0, 1.0]  # terminated wins when both flags are set
    adv_no_final, _ = gae(
        reward, value, next_value, done, gamma=0.5, lam=1.0, terminated=terminated
    )
    assert adv_no_final[:, 0].tolist() == [1.0, 1.0, 1.0]  # no value: truncation as terminal


def test_compute_gae_attaches_to_view_and_to_raw_rollout() -> None:
    buf = RolloutBuffer(2, 3, 1, 1)
    rollout = buf.start_rollout()
    rollout["reward"][:, :3] = 1.0
    rollout["value"].copy_(torch.arange(8, dtype=torch.float32).reshape(2, 4))
    rollout["done"][0, 1] = rollout["terminated"][0, 1] = True
    rollout["truncated"][1, 0] = rollout["done"][1, 0] = True
    rollout["final_value"][1, 0] = 3.0
    adv_raw, ret_raw = compute_gae(rollout, gamma=0.9, lam=0.8)
    assert rollout["advantage"].shape == (2, 4) and rollout["advantage"][:, 3].eq(0).all()
    flat = transition_view(rollout, flatten=True)
    assert torch.equal(flat["advantage"], adv_raw.reshape(-1))
    assert torch.equal(flat["return"], ret_raw.reshape(-1))
    buf.add(rollout)
    view = buf.get(flatten=False)
    adv_view, ret_view = compute_gae(view, gamma=0.9, lam=0.8)
    assert torch.equal(adv_view, adv_raw) and torch.equal(view["return"], ret_view)
    # env 1 was truncated at t=0: delta = 1 + 0.9 * 3 - 4, no carry from later steps
    assert adv_view[1, 0].item() == pytest.approx(1 + 0.9 * 3.0 - 4.0)
    # env 0 terminated at t=1: delta = 1 - 1
    assert adv_view[0, 1].item() == pytest.approx(0.0)


def test_gae_errors_name_the_problem() -> None:
    x = torch.zeros(2, 3)
    done = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"gamma must be a float in \[0, 1\], got 1.5"):
        gae(x, x, x, done, gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match=r"'value' has shape \[2, 4\] but reward has \[2, 3\]"):
        gae(x, torch.zeros(2, 4), x, done, gamma=0.9, lam=0.9)
    buf = RolloutBuffer(2, 3, 1, 1)
    flat = transition_view(buf.start_rollout(), flatten=True)
    with pytest.raises(ValueError, match=r"unflattened \[N, T\] view.*got batch shape \[6\]"):
        compute_gae(flat, gamma=0.9, lam=0.9)
