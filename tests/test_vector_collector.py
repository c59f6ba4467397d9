"""VectorCollector on real Gymnasium CartPole vector envs with a small deterministic policy."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn
from torchdata.nodes import Loader

from rollpipe._utils.seeding import derive_seed
from rollpipe.training.ppo_buffer import RolloutBuffer
from rollpipe.training.vector_collector import VectorCollector


class BalancePolicy(nn.Module):
    """Pushes toward the falling side (keeps CartPole up); value = weighted obs sum.

    Records every observation batch it is asked to value, so tests can check bootstraps.
    """

    def __init__(self, action_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = torch.tensor([1.0, -2.0, 3.0, -4.0])
        self.action_dtype = action_dtype
        self.valued: list[torch.Tensor] = []

    def _action(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs[:, 2] + obs[:, 3] > 0).to(self.action_dtype).unsqueeze(-1)

    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._action(obs), torch.full((obs.shape[0],), -0.5), obs @ self.w

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        self.valued.append(obs.clone())
        return obs @ self.w


def make_env(n: int, max_steps: int = 500, mode: str = "SameStep") -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=max_steps) for _ in range(n)],
        autoreset_mode=gym.vector.AutoresetMode(mode),
    )


def test_rollout_fields_follow_the_env_and_bootstrap_from_the_last_obs() -> None:
    n, t = 3, 7
    policy = BalancePolicy()
    env = make_env(n)
    buf = RolloutBuffer(n, t, obs_dim=4, action_dim=1)
    collector = VectorCollector(env, policy, buf, seed=5, num_rollouts=2)
    first = next(collector).clone()  # views alias the shared storage: keep a copy
    assert first.batch_size == torch.Size([n, t])
    assert first["reward"].eq(1.0).all()
    assert first["sample_log_prob"].eq(-0.5).all()
    assert torch.equal(first["done"], first["terminated"] | first["truncated"])
    assert torch.allclose(first["value"], first["obs"] @ policy.w)
    # the first observation is what the env returns for the derived reset seed
    ref = gym.make("CartPole-v1")
    for i in range(n):
        obs0, _ = ref.reset(seed=derive_seed(5, 0) + i)
        assert torch.allclose(first["obs"][i, 0], torch.from_numpy(obs0))
    bootstrap_obs = policy.valued[-1]
    assert torch.allclose(first["next_value"][:, -1], bootstrap_obs @ policy.w)
    assert torch.allclose(first["next_value"][:, :-1], first["value"][:, 1:])
    second = next(collector)
    assert torch.equal(second["obs"][:, 0], bootstrap_obs)  # episodes continue across rollouts
    with pytest.raises(StopIteration):
        next(collector)


def test_truncation_records_value_of_the_final_observation() -> None:
    n, t, limit, seed = 2, 12, 5, 3
    policy = BalancePolicy()
    buf = RolloutBuffer(n, t, obs_dim=4, action_dim=1)
    collector = VectorCollector(make_env(n, max_steps=limit), policy, buf, seed=seed)
    view = next(collector)
    truncated_at = [4, 9]  # the balancing policy never fails within 5 steps
    expect = torch.zeros(n, t, dtype=torch.bool)
    expect[:, truncated_at] = True
    assert torch.equal(view["truncated"], expect)
    assert not view["terminated"].any()
    assert collector.episode_returns == [5.0] * 4 and collector.episode_lengths == [5] * 4
    for i in range(n):  # replay env i by hand to get its true final observation
        env = gym.make("CartPole-v1", max_episode_steps=limit)
        obs, _ = env.reset(seed=derive_seed(seed, 0) + i)
        for _ in range(limit):
            action = int(policy._action(torch.from_numpy(obs)[None])[0, 0])
            obs, *_ = env.step(action)
        final = float(torch.from_numpy(obs) @ policy.w)
        assert view["final_value"][i, 4].item() == pytest.approx(final, abs=1e-5)
        # after the autoreset, obs[5] is the next episode's first observation, not the final one
        assert not torch.allclose(view["obs"][i, 5], torch.from_numpy(obs))
    untouched = torch.ones(n, t, dtype=torch.bool)
    untouched[:, truncated_at] = False
    assert view["final_value"][untouched].eq(0).all()


def test_loader_state_and_resume_count_rollouts() -> None:
    buf = RolloutBuffer(2, 4, obs_dim=4, action_dim=1)
    node = VectorCollector(make_env(2), BalancePolicy(), buf, seed=1, num_rollouts=3)
    loader = Loader(node)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert len(list(it)) == 2
    node.reset(node.get_state())
    with pytest.raises(StopIteration):
        next(node)  # all 3 rollouts were produced
    resumed = VectorCollector(make_env(2), BalancePolicy(), buf, seed=1, num_rollouts=3)
    loader2 = Loader(resumed)
    loader2.load_state_dict(state)
    assert len(list(loader2)) == 2  # the 2 rollouts not yet yielded at the checkpoint


def test_policy_with_wrong_action_dtype_gets_the_buffer_error() -> None:
    buf = RolloutBuffer(2, 3, obs_dim=4, action_dim=1)
    collector = VectorCollector(make_env(2), BalancePolicy(torch.int64), buf)
    with pytest.raises(TypeError, match=r"'action' must have dtype torch.float32, got torch.int64"):
        next(collector)


def test_misconfiguration_is_rejected_at_construction() -> None:
    buf = RolloutBuffer(2, 3, obs_dim=4, action_dim=1)
    with pytest.raises(
        ValueError, match=r"autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP"
    ):
        VectorCollector(make_env(2, mode="NextStep"), BalancePolicy(), buf)
    with pytest.raises(ValueError, match=r"env.num_envs=3 != buffer.num_envs=2"):
        VectorCollector(make_env(3), BalancePolicy(), buf)
    with pytest.raises(ValueError, match=r"flatten to 4 values but the buffer has obs_dim=5"):
        VectorCollector(make_env(2), BalancePolicy(), RolloutBuffer(2, 3, 5, 1))
    with pytest.raises(ValueError, match=r"Discrete action space needs buffer action_dim=1, got 2"):
        VectorCollector(make_env(2), BalancePolicy(), RolloutBuffer(2, 3, 4, 2))


def test_box_actions_are_reshaped_for_the_env() -> None:
    env = gym.vector.SyncVectorEnv(
        [lambda: gym.make("Pendulum-v1") for _ in range(2)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )

    class Torque(nn.Module):
        def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return torch.full((obs.shape[0], 1), 0.5), torch.zeros(obs.shape[0]), obs[:, 0]

        def value(self, obs: torch.Tensor) -> torch.Tensor:
            return obs[:, 0]

    view = next(VectorCollector(env, Torque(), RolloutBuffer(2, 4, 3, 1)))
    assert view["action"].eq(0.5).all()
    assert np.isfinite(view["reward"].numpy()).all() and view["reward"].lt(0).all()
