"""RolloutBuffer: storage layout, lifecycle, checked writes, transition view, minibatches."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from rollpipe.training.ppo_buffer import (
    RolloutBuffer,
    RolloutBufferError,
    is_transition_view,
    iterate_minibatches,
    transition_view,
)

SIZES = st.integers(min_value=1, max_value=5)


def _filled(n: int, t: int, obs_dim: int = 3, action_dim: int = 2) -> RolloutBuffer:
    """A buffer whose ready rollout holds distinct values (value[i, s] = 100 * i + s)."""
    buf = RolloutBuffer(n, t, obs_dim, action_dim, "cpu")
    rollout = buf.start_rollout()
    for s in range(t + 1):
        step = torch.arange(n, dtype=torch.float32) * 100 + s
        buf.write(s, obs=step[:, None].expand(n, obs_dim).contiguous(), value=step)
        if s < t:
            buf.write(
                s,
                action=step[:, None].expand(n, action_dim).contiguous(),
                reward=step + 0.5,
                sample_log_prob=-step,
                done=torch.zeros(n, dtype=torch.bool),
            )
    buf.add(rollout)
    return buf


def test_preallocated_fields_have_the_documented_shapes_and_dtypes() -> None:
    buf = RolloutBuffer(4, 6, 3, 2, "cpu")
    td = buf.start_rollout()
    assert td.batch_size == torch.Size([4, 7])
    f32, b = torch.float32, torch.bool
    expected = {
        "obs": (f32, (4, 7, 3)),
        "action": (f32, (4, 7, 2)),
        "sample_log_prob": (f32, (4, 7)),
        "value": (f32, (4, 7)),
        "reward": (f32, (4, 7)),
        "final_value": (f32, (4, 7)),
        "done": (b, (4, 7)),
        "terminated": (b, (4, 7)),
        "truncated": (b, (4, 7)),
    }
    assert set(td.keys()) == set(expected)
    for key, (dtype, shape) in expected.items():
        assert td[key].dtype == dtype, key
        assert tuple(td[key].shape) == shape, key
    assert buf.start_rollout() is td  # one shared storage, allocated once


def test_get_returns_consumed_transition_view() -> None:
    buf = _filled(2, 3)
    flat = buf.get()
    assert flat.batch_size == torch.Size([6])
    assert buf.state == "idle"
    with pytest.raises(RolloutBufferError, match=r"rollouts are consumed once"):
        buf.get()
    buf2 = _filled(2, 3)
    view = buf2.get(flatten=False)
    assert view.batch_size == torch.Size([2, 3])
    assert torch.equal(view["value"][1], torch.tensor([100.0, 101.0, 102.0]))
    assert torch.equal(view["next_value"][1], torch.tensor([101.0, 102.0, 103.0]))
    assert torch.equal(view["reward"][0], torch.tensor([0.5, 1.5, 2.5]))


def test_lifecycle_misuse_raises_clear_errors() -> None:
    buf = RolloutBuffer(2, 3, 1, 1)
    with pytest.raises(RolloutBufferError, match=r"add\(\).*never started"):
        buf.add(TensorDict({}, batch_size=[2, 4]))
    with pytest.raises(RolloutBufferError, match=r"get\(\).*no rollout was added"):
        buf.get()
    td = buf.start_rollout()
    with pytest.raises(RolloutBufferError, match=r"get\(\).*start_rollout\(\) was called but add"):
        buf.get()
    with pytest.raises(RolloutBufferError, match=r"expected the TensorDict returned by start"):
        buf.add(td.clone())
    buf.add(td)
    with pytest.raises(RolloutBufferError, match=r"already added"):
        buf.add(td)
    with pytest.raises(RolloutBufferError, match=r"never consumed; call get\(\)"):
        buf.start_rollout()
    with pytest.raises(RolloutBufferError, match=r"write\(t=0\).*call start_rollout"):
        buf.write(0, reward=torch.zeros(2))


def test_checked_write_names_field_and_sizes() -> None:
    buf = RolloutBuffer(2, 3, obs_dim=4, action_dim=1)
    buf.start_rollout()
    with pytest.raises(ValueError, match=re.escape("'obs' at t=1 must have shape [2, 4]")):
        buf.write(1, obs=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=re.escape("got [3]")):
        buf.write(0, reward=torch.zeros(3))
    with pytest.raises(
        TypeError, match=r"'reward' must have dtype torch.float32, got torch.float64"
    ):
        buf.write(0, reward=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"'done' must have dtype torch.bool, got torch.int64"):
        buf.write(0, done=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"'value' must be a torch.Tensor, got list"):
        buf.write(0, value=[0.0, 0.0])  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"unknown field 'advantage'"):
        buf.write(0, advantage=torch.zeros(2))
    with pytest.raises(
        IndexError, match=r"t=3 is the padding slot of transition-only field 'reward'"
    ):
        buf.write(3, reward=torch.zeros(2))
    with pytest.raises(IndexError, match=re.escape("t must be an int in [0, 3], got 4")):
        buf.write(4, obs=torch.zeros(2, 4))
    buf.write(3, obs=torch.ones(2, 4), value=torch.ones(2))  # the bootstrap slot is writable
    assert buf.start_rollout()["value"][:, 3].tolist() == [1.0, 1.0]


def test_add_rejects_a_field_replaced_with_wrong_dtype_or_shape() -> None:
    buf = RolloutBuffer(2, 3, 1, 1)
    td = buf.start_rollout()
    td["reward"] = torch.zeros(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"field 'reward' must be torch.float32 \[2, 4\].*float64"):
        buf.add(td)
    td["reward"] = torch.zeros(2, 4)
    td["obs"] = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match=re.escape("'obs' must be torch.float32 [2, 4, 1]")):
        buf.add(td)


def test_start_rollout_drops_attached_fields_and_zeroes_final_value() -> None:
    buf = RolloutBuffer(2, 3, 1, 1)
    td = buf.start_rollout()
    td["final_value"][:, 1] = 5.0
    td["advantage"] = torch.ones(2, 4)
    buf.add(td)
    buf.get()
    td = buf.start_rollout()
    assert "advantage" not in td
    assert td["final_value"].abs().sum().item() == 0.0


@settings(max_examples=40, deadline=None)
@given(n=SIZES, t=SIZES, obs_dim=SIZES, action_dim=SIZES)
def test_transition_view_shapes_for_any_sizes(
    n: int, t: int, obs_dim: int, action_dim: int
) -> None:
    buf = RolloutBuffer(n, t, obs_dim, action_dim)
    rollout = buf.start_rollout()
    rollout["value"].copy_(torch.randn(n, t + 1))
    rollout["advantage"] = torch.randn(n, t + 1)  # attached algorithm field
    view = transition_view(rollout)
    assert view.batch_size == torch.Size([n, t])
    assert view["obs"].shape == (n, t, obs_dim)
    assert view["action"].shape == (n, t, action_dim)
    for key in ("reward", "done", "terminated", "truncated", "value", "next_value", "advantage"):
        assert view[key].shape == (n, t), key
    assert torch.equal(view["next_value"][:, -1], rollout["value"][:, t])  # bootstrap value
    assert torch.equal(view["value"], rollout["value"][:, :t])
    assert view["obs"].data_ptr() == rollout["obs"].data_ptr()  # a view, not a copy
    flat = transition_view(rollout, flatten=True)
    assert flat.batch_size == torch.Size([n * t])
    assert flat["obs"].shape == (n * t, obs_dim)
    assert torch.equal(flat["advantage"], rollout["advantage"][:, :t].reshape(-1))
    assert is_transition_view(view) and not is_transition_view(rollout)
    again = transition_view(view, flatten=True)  # a view is only flattened, not re-sliced
    assert again.batch_size == torch.Size([n * t])
    assert transition_view(view) is view


def test_transition_view_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[N, T\+1\] with T >= 1, got \[3, 1\]"):
        transition_view(TensorDict({"obs": torch.zeros(3, 1, 2)}, batch_size=[3, 1]))
    with pytest.raises(KeyError, match=r"no 'value' field"):
        transition_view(TensorDict({"obs": torch.zeros(3, 2, 2)}, batch_size=[3, 2]))


@settings(max_examples=60, deadline=None)
@given(
    n=SIZES,
    t=SIZES,
    data=st.data(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_minibatches_cover_every_transition_once_per_epoch(
    n: int, t: int, data: st.DataObject, shuffle: bool, seed: int
) -> None:
    buf = _filled(n, t)
    flat = buf.get(flatten=True)
    flat["uid"] = torch.arange(n * t)
    batch_size = data.draw(st.integers(1, n * t), label="batch_size")
    for _epoch in range(2):
        gen = torch.Generator().manual_seed(seed)
        batches = list(iterate_minibatches(flat, batch_size, "cpu", shuffle, gen))
        seen = torch.cat([b["uid"] for b in batches])
        assert sorted(seen.tolist()) == list(range(n * t))
        assert all(b.batch_size[0] == batch_size for b in batches[:-1])
        assert 1 <= batches[-1].batch_size[0] <= batch_size
        for b in batches:  # rows stay aligned across fields
            assert torch.equal(b["value"], flat["value"][b["uid"]])
        if not shuffle:
            assert seen.tolist() == list(range(n * t))


def test_minibatches_accept_unflattened_view_and_follow_generator() -> None:
    view = _filled(3, 4).get(flatten=False)
    a = [
        b["value"]
        for b in iterate_minibatches(view, 5, None, generator=torch.Generator().manual_seed(1))
    ]
    b = [
        b["value"]
        for b in iterate_minibatches(view, 5, None, generator=torch.Generator().manual_seed(1))
    ]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert sum(x.numel() for x in a) == 12


def test_minibatch_misuse_errors() -> None:
    buf = _filled(2, 3)
    flat = buf.get()
    with pytest.raises(ValueError, match=r"batch_size=7 is larger than the data \(6 transitions\)"):
        next(iterate_minibatches(flat, 7, "cpu"))
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 0"):
        next(iterate_minibatches(flat, 0, "cpu"))
    raw = RolloutBuffer(2, 3, 1, 1).start_rollout()
    with pytest.raises(ValueError, match=r"\[2, 4\] TensorDict that is not a transition view"):
        next(iterate_minibatches(raw, 2, "cpu"))


def test_constructor_validates_sizes() -> None:
    with pytest.raises(ValueError, match=r"rollout_len must be an int >= 1, got 0"):
        RolloutBuffer(2, 0, 1, 1)
    with pytest.raises(ValueError, match=r"obs_dim must be an int >= 1, got -1"):
        RolloutBuffer(2, 3, -1, 1)
