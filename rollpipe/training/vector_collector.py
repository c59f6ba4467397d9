"""VectorCollector: a torchdata node that fills a RolloutBuffer from a Gymnasium vector env.

Each ``next()`` steps the vector env ``T`` times with a torch actor-critic, writes the steps
into the buffer's shared storage, adds it and returns the consumed ``[N, T]`` transition view
(``buffer.get(flatten=False)``). Episodes continue across rollouts (the env is never reset
between them). Data crosses the host/device boundary only where it must: env outputs
(observations, rewards, flags) go in once, straight into the buffer; actions come out once
for the env.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, VectorEnv
from tensordict import TensorDict
from torchdata.nodes import BaseNode

from rollpipe._utils.checks import check_int
from rollpipe._utils.seeding import derive_seed
from rollpipe.training.ppo_buffer import RolloutBuffer

__all__ = ["ActorCritic", "VectorCollector"]


class ActorCritic(Protocol):
    """What the collector needs from a policy (an ``nn.Module`` with two methods is typical)."""

    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``obs`` float32 ``[N, obs_dim]`` -> (action float32 ``[N, action_dim]``,
        log-prob float32 ``[N]``, value float32 ``[N]``). Discrete actions: float indices."""
        ...

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs`` float32 ``[K, obs_dim]`` -> value float32 ``[K]``."""
        ...


def _default_action_to_env(
    space: gym.Space[Any], num_envs: int, action_dim: int
) -> Callable[[torch.Tensor], np.ndarray]:
    if isinstance(space, gym.spaces.Discrete):
        if action_dim != 1:
            raise ValueError(
                "VectorCollector: a Discrete action space needs buffer action_dim=1, got "
                f"{action_dim}"
            )
        start = int(space.start)
        return lambda a: a[:, 0].to(torch.int64).cpu().numpy() + start
    if isinstance(space, gym.spaces.Box):
        size = int(np.prod(space.shape))
        if size != action_dim:
            raise ValueError(
                f"VectorCollector: Box action space of shape {space.shape} has {size} "
                f"entries but the buffer has action_dim={action_dim}"
            )
        shape = (num_envs, *space.shape)
        return lambda a: a.cpu().numpy().reshape(shape).astype(space.dtype, copy=False)
    raise ValueError(
        f"VectorCollector: no default action conversion for {type(space).__name__}; pass "
        "action_to_env=callable(action [N, action_dim] tensor) -> env action batch"
    )


class VectorCollector(BaseNode[TensorDict]):
    """Yields one ``[N, T]`` transition view per ``next()`` (``num_rollouts`` of them, or forever).

    The env must autoreset in ``SAME_STEP`` mode, so that ``obs[t+1]`` after an episode end is
    the new episode's first observation and the final one is in ``info["final_obs"]``; for
    truncated (not terminated) steps ``final_value[t] = policy.value(final_obs)``.
    ``episode_returns`` / ``episode_lengths`` list the episodes finished in the last rollout.

    State is ``{"num_yielded", "seed"}``: a gymnasium env cannot be snapshotted, so a resumed
    collector re-seeds the env with ``derive_seed(seed, num_yielded)`` and starts fresh
    episodes (the rollouts yielded before the checkpoint are not repeated).
    """

    def __init__(
        self,
        env: VectorEnv,
        policy: ActorCritic,
        buffer: RolloutBuffer,
        *,
        seed: int = 0,
        num_rollouts: int | None = None,
        action_to_env: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        super().__init__()
        if env.num_envs != buffer.num_envs:
            raise ValueError(
                f"VectorCollector: env.num_envs={env.num_envs} != buffer.num_envs={buffer.num_envs}"
            )
        mode = env.metadata.get("autoreset_mode")
        if mode != AutoresetMode.SAME_STEP:
            raise ValueError(
                f"VectorCollector: env autoreset_mode is {mode!r}; build the vector env with "
                "autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP"
            )
        obs_dim = gym.spaces.flatdim(env.single_observation_space)
        if obs_dim != buffer.obs_dim:
            raise ValueError(
                f"VectorCollector: env observations flatten to {obs_dim} values but the "
                f"buffer has obs_dim={buffer.obs_dim}"
            )
        if num_rollouts is not None:
            check_int("VectorCollector: num_rollouts (or None)", num_rollouts, 0)
        self.env, self.policy, self.buffer = env, policy, buffer
        self.seed, self.num_rollouts = seed, num_rollouts
        self._action_to_env = action_to_env or _default_action_to_env(
            env.single_action_space, env.num_envs, buffer.action_dim
        )
        self._num_yielded = 0
        self._ep_return = np.zeros(env.num_envs, dtype=np.float64)
        self._ep_len = np.zeros(env.num_envs, dtype=np.int64)
        self.episode_returns: list[float] = []
        self.episode_lengths: list[int] = []

    def _host_obs(self, obs: np.ndarray) -> torch.Tensor:
        """Env observations as a CPU float32 ``[K, obs_dim]`` tensor (no device copy yet)."""
        arr = np.asarray(obs, dtype=np.float32).reshape(len(obs), -1)
        return torch.from_numpy(arr)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._num_yielded = int(initial_state["num_yielded"])
            self.seed = int(initial_state["seed"])
        else:
            self._num_yielded = 0
        obs, _ = self.env.reset(seed=derive_seed(self.seed, self._num_yielded))
        self._next_obs = self._host_obs(obs)
        self._ep_return[:] = 0.0
        self._ep_len[:] = 0
        self.episode_returns, self.episode_lengths = [], []

    def get_state(self) -> dict[str, Any]:
        return {"num_yielded": self._num_yielded, "seed": self.seed}

    def next(self) -> TensorDict:
        if self.num_rollouts is not None and self._num_yielded >= self.num_rollouts:
            raise StopIteration
        buf, T = self.buffer, self.buffer.rollout_len
        rollout = buf.start_rollout()
        obs_store = rollout.get("obs")
        self.episode_returns, self.episode_lengths = [], []
        with torch.no_grad():
            buf.write(0, obs=self._next_obs)
            for t in range(T):
                obs = obs_store[:, t]
                action, log_prob, value = self.policy.act(obs)
                buf.write(t, action=action, sample_log_prob=log_prob, value=value)
                next_obs, reward, terminated, truncated, info = self.env.step(
                    self._action_to_env(action)
                )
                terminated = np.asarray(terminated, dtype=bool)
                truncated = np.asarray(truncated, dtype=bool)
                done = terminated | truncated
                buf.write(
                    t,
                    reward=torch.from_numpy(np.asarray(reward, dtype=np.float32)),
                    terminated=torch.from_numpy(terminated),
                    truncated=torch.from_numpy(truncated),
                    done=torch.from_numpy(done),
                )
                buf.write(t + 1, obs=self._host_obs(next_obs))
                self._track_episodes(np.asarray(reward, dtype=np.float64), done)
                only_trunc = np.flatnonzero(truncated & ~terminated)
                if only_trunc.size:
                    self._write_final_value(t, info, only_trunc)
            buf.write(T, value=self.policy.value(obs_store[:, T]))
        self._next_obs = obs_store[:, T].clone()  # device-side; seeds the next rollout's t=0
        buf.add(rollout)
        self._num_yielded += 1
        return buf.get(flatten=False)

    def _write_final_value(self, t: int, info: dict[str, Any], rows: np.ndarray) -> None:
        final_obs = info["final_obs"]
        host = self._host_obs(np.stack([np.asarray(final_obs[i]) for i in rows]))
        values = self.policy.value(host.to(self.buffer.device, non_blocking=True))
        final_value = torch.zeros(self.buffer.num_envs, device=values.device)
        final_value[torch.from_numpy(rows).to(values.device)] = values.float()
        self.buffer.write(t, final_value=final_value)

    def _track_episodes(self, reward: np.ndarray, done: np.ndarray) -> None:
        self._ep_return += reward
        self._ep_len += 1
        for i in np.flatnonzero(done):
            self.episode_returns.append(float(self._ep_return[i]))
            self.episode_lengths.append(int(self._ep_len[i]))
        self._ep_return[done] = 0.0
        self._ep_len[done] = 0
