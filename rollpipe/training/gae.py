"""Generalized Advantage Estimation (GAE) over rollout transitions.

Semantics per step ``t`` (time is the last dimension):

- ``done[t]``: the episode ended at step ``t``; ``obs[t+1]`` starts a new episode, so the
  advantage recursion is cut there.
- ``terminated[t]``: a true terminal state, the bootstrap value is 0.
- truncated (``done`` but not ``terminated``): bootstrap with ``final_value[t]`` =
  V(final observation) when the collector recorded it; without it the step is treated as
  terminal (biased low, the usual fallback).
- otherwise bootstrap with ``next_value[t]`` (= ``value[t+1]``; at ``t = T-1`` the
  rollout's bootstrap value).

``advantage[t] = delta[t] + gamma * lam * (1 - done[t]) * advantage[t+1]`` with
``delta[t] = reward[t] + gamma * bootstrap[t] - value[t]``, and ``return = advantage + value``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rollpipe.training.ppo_buffer import is_transition_view, transition_view

__all__ = ["compute_gae", "gae"]


def _check_coef(name: str, x: float) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0.0 <= x <= 1.0:
        raise ValueError(f"GAE {name} must be a float in [0, 1], got {x!r}")
    return float(x)


def gae(
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    done: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    terminated: torch.Tensor | None = None,
    final_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(advantage, return)`` for tensors shaped ``[..., T]`` (see module docstring).

    ``terminated`` defaults to ``done`` (every episode end is terminal); ``final_value``
    defaults to no truncation bootstrap. All inputs must share one shape.
    """
    gamma, lam = _check_coef("gamma", gamma), _check_coef("lam", lam)
    named = {"reward": reward, "value": value, "next_value": next_value, "done": done}
    if terminated is not None:
        named["terminated"] = terminated
    if final_value is not None:
        named["final_value"] = final_value
    shape = reward.shape
    for name, x in named.items():
        if x.shape != shape:
            raise ValueError(
                f"gae: {name!r} has shape {list(x.shape)} but reward has {list(shape)}; "
                "all inputs are [..., T] with time last"
            )
    if reward.dim() == 0 or shape[-1] == 0:
        raise ValueError(f"gae: inputs need a non-empty time dimension, got shape {list(shape)}")
    term = done.bool() if terminated is None else terminated.bool()
    ended = done.bool() | term
    value_f = value.float()
    zero = torch.zeros_like(value_f)
    trunc_value = zero if final_value is None else final_value.float()
    bootstrap = torch.where(ended, torch.where(term, zero, trunc_value), next_value.float())
    delta = reward.float() + gamma * bootstrap - value_f
    carry_coef = gamma * lam * (~ended).float()
    advantage = torch.empty_like(delta)
    running = torch.zeros_like(delta[..., 0])
    for t in range(shape[-1] - 1, -1, -1):
        running = delta[..., t] + carry_coef[..., t] * running
        advantage[..., t] = running
    return advantage, advantage + value_f


def compute_gae(
    rollout: TensorDictBase, *, gamma: float, lam: float, attach: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on a rollout or its ``[N, T]`` transition view; returns ``(advantage, return)``.

    Uses ``reward``, ``value``, ``next_value``, ``done`` and, when present, ``terminated``
    and ``final_value``. With ``attach``, stores ``advantage`` and ``return`` on the input:
    ``[N, T]`` on a view; on a raw ``[N, T+1]`` rollout padded with a zero final slot (so
    ``transition_view`` carries them through).
    """
    view = rollout if is_transition_view(rollout) else transition_view(rollout)
    if view.batch_dims != 2:
        raise ValueError(
            f"compute_gae needs the unflattened [N, T] view (time axis), got batch shape "
            f"{list(view.batch_size)}; call it before flattening"
        )
    for key in ("reward", "value", "next_value", "done"):
        if key not in view:
            raise KeyError(f"compute_gae: rollout has no {key!r} field")
    keys = view.keys()
    advantage, ret = gae(
        view.get("reward"),
        view.get("value"),
        view.get("next_value"),
        view.get("done"),
        gamma=gamma,
        lam=lam,
        terminated=view.get("terminated") if "terminated" in keys else None,
        final_value=view.get("final_value") if "final_value" in keys else None,
    )
    if attach:
        if view is rollout:
            rollout.set("advantage", advantage)
            rollout.set("return", ret)
        else:
            n, t = view.batch_size
            for key, x in (("advantage", advantage), ("return", ret)):
                padded = torch.zeros((n, t + 1), dtype=x.dtype, device=x.device)
                padded[:, :t] = x
                rollout.set(key, padded)
    return advantage, ret
