"""PPO on Gymnasium's CartPole-v1 (CPU) with rollpipe's RolloutBuffer, VectorCollector and GAE.

Run: ``python examples/ppo_cartpole.py [--total-steps 150000] [--seed 0]``. ``main()`` returns
the mean episodic return of each iteration (episodes that finished during that iteration's
rollout; an iteration where none finished repeats the previous value).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn
from torch.distributions import Categorical

from rollpipe.training.gae import compute_gae
from rollpipe.training.ppo_buffer import RolloutBuffer, iterate_minibatches, transition_view
from rollpipe.training.vector_collector import VectorCollector


def _layer(n_in: int, n_out: int, std: float = math.sqrt(2)) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.zeros_(layer.bias)
    return layer


class Agent(nn.Module):
    """Separate tanh MLPs for the policy logits and the value (CleanRL's CartPole agent)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            _layer(obs_dim, hidden), nn.Tanh(), _layer(hidden, hidden), nn.Tanh(),
            _layer(hidden, 1, std=1.0),
        )  # fmt: skip
        self.actor = nn.Sequential(
            _layer(obs_dim, hidden), nn.Tanh(), _layer(hidden, hidden), nn.Tanh(),
            _layer(hidden, num_actions, std=0.01),
        )  # fmt: skip

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist = Categorical(logits=self.actor(obs))
        action = dist.sample()
        return action.float().unsqueeze(-1), dist.log_prob(action), self.value(obs)

    def evaluate(
        self, obs: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-prob and entropy of stored (float, ``[B, 1]``) actions, and the value."""
        dist = Categorical(logits=self.actor(obs))
        index = action[:, 0].long()
        return dist.log_prob(index), dist.entropy(), self.value(obs)


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"PPOConfig.{attribute.name} must be > 0, got {value!r}")


def _unit(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"PPOConfig.{attribute.name} must be in [0, 1], got {value!r}")


@attrs.frozen
class PPOConfig:
    """PPO hyperparameters (CleanRL's CartPole settings, with 8 envs and lr 1e-3)."""

    num_envs: int = attrs.field(default=8, validator=_positive)
    rollout_len: int = attrs.field(default=128, validator=_positive)
    lr: float = attrs.field(default=1e-3, validator=_positive)  # linearly annealed to 0
    gamma: float = attrs.field(default=0.99, validator=_unit)
    lam: float = attrs.field(default=0.95, validator=_unit)
    epochs: int = attrs.field(default=4, validator=_positive)
    num_minibatches: int = attrs.field(default=4, validator=_positive)
    clip: float = attrs.field(default=0.2, validator=_positive)
    ent_coef: float = attrs.field(default=0.01, validator=_unit)
    vf_coef: float = attrs.field(default=0.5, validator=_positive)
    max_grad_norm: float = attrs.field(default=0.5, validator=_positive)


def main(
    total_steps: int = 150_000,
    seed: int = 0,
    *,
    config: PPOConfig | None = None,
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """Train for ``total_steps`` env steps; return each iteration's mean episodic return.

    Runs on one CPU thread (small MLPs: threads only add overhead); restored on exit.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(total_steps, seed, config or PPOConfig(), log)
    finally:
        torch.set_num_threads(threads)


def _train(
    total_steps: int, seed: int, cfg: PPOConfig, log: Callable[[str], None] | None
) -> list[float]:
    torch.manual_seed(seed)
    n, T = cfg.num_envs, cfg.rollout_len
    env = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1") for _ in range(n)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    obs_dim = gym.spaces.flatdim(env.single_observation_space)
    agent = Agent(obs_dim, int(env.single_action_space.n))  # type: ignore[attr-defined]
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)
    buffer = RolloutBuffer(n, T, obs_dim, action_dim=1, device="cpu")
    iterations = max(1, total_steps // (n * T))
    collector = VectorCollector(env, agent, buffer, seed=seed, num_rollouts=iterations)
    batch_size = n * T // cfg.num_minibatches
    generator = torch.Generator().manual_seed(seed)
    returns: list[float] = []
    start = time.perf_counter()
    for it, rollout in enumerate(collector):  # rollout: [N, T] transition view
        for group in optimizer.param_groups:  # linear learning-rate annealing
            group["lr"] = cfg.lr * (1.0 - it / iterations)
        compute_gae(rollout, gamma=cfg.gamma, lam=cfg.lam)  # attaches "advantage", "return"
        flat = transition_view(rollout, flatten=True)
        for _ in range(cfg.epochs):
            for batch in iterate_minibatches(flat, batch_size, "cpu", generator=generator):
                _update(agent, optimizer, batch, cfg)
        finished = collector.episode_returns
        returns.append(float(np.mean(finished)) if finished else (returns[-1] if returns else 0.0))
        if log is not None:
            log(
                f"iter {it + 1:4d}/{iterations}  steps {(it + 1) * n * T:7d}  "
                f"mean return {returns[-1]:6.1f} ({len(finished)} episodes)  "
                f"{time.perf_counter() - start:6.1f}s"
            )
    env.close()
    return returns


def _update(
    agent: Agent, optimizer: torch.optim.Optimizer, batch: TensorDict, cfg: PPOConfig
) -> None:
    """One clipped-PPO gradient step on a minibatch of transitions."""
    new_logp, entropy, value = agent.evaluate(batch["obs"], batch["action"])
    ratio = (new_logp - batch["sample_log_prob"]).exp()
    adv = batch["advantage"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    clipped = ratio.clamp(1 - cfg.clip, 1 + cfg.clip)
    pg_loss = -torch.min(ratio * adv, clipped * adv).mean()
    v_loss = 0.5 * (value - batch["return"]).pow(2).mean()
    loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * entropy.mean()
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
    optimizer.step()


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-steps", type=int, default=150_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="only print the summary")
    args = parser.parse_args()
    start = time.perf_counter()
    returns = main(args.total_steps, args.seed, log=None if args.quiet else print)
    wall = time.perf_counter() - start
    per_iter = PPOConfig().num_envs * PPOConfig().rollout_len

    def first(pred: Callable[[int], bool]) -> str:
        i = next((i for i in range(len(returns)) if pred(i)), None)
        return "never" if i is None else f"iteration {i + 1} ({(i + 1) * per_iter} steps)"

    smooth = first(lambda i: i >= 9 and float(np.mean(returns[i - 9 : i + 1])) > 195)
    print(
        f"final mean return {returns[-1]:.1f} (last 10 iterations {np.mean(returns[-10:]):.1f}); "
        f"> 195 first at {first(lambda i: returns[i] > 195)}, 10-iteration mean > 195 first "
        f"at {smooth}; {wall:.1f}s wall"
    )


if __name__ == "__main__":
    _cli()
