"""GRPO pieces a trainer needs on top of rollpipe's rows.

Small on purpose: group-normalised advantages keyed by ``traj_group_id``, the
policy's log-probabilities of the rows' tokens, and the clipped policy-gradient loss
over ``response_mask`` tokens (ratios against the engine's ``infer_logprobs``).
"""

from __future__ import annotations

import torch

from rollpipe.data.proto import DataProto


def group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, scale: bool = True
) -> torch.Tensor:
    """``(score - group mean) / (group std + eps)`` per row (GRPO's outcome advantage).

    ``scale=False`` only centres (Dr. GRPO). Groups of one row get advantage 0.
    """
    if scores.shape != group_ids.shape or scores.dim() != 1:
        raise ValueError(
            f"group_advantages: scores {tuple(scores.shape)} and group_ids "
            f"{tuple(group_ids.shape)} must be equal 1-D shapes"
        )
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    scores = scores.to(torch.float64)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, scores)
    means = sums / counts
    centred = scores - means[inverse]
    squares = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, centred**2)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))[inverse]
    advantages = centred / (std + eps) if scale else centred
    return torch.where(counts[inverse] > 1, advantages, torch.zeros_like(advantages)).float()


def token_logprobs(model: torch.nn.Module, batch: DataProto) -> torch.Tensor:
    """Log-probability the model gives each row token, aligned with ``input_ids`` (0 at t=0)."""
    td = batch.batch
    if td is None:
        raise ValueError("token_logprobs needs a DataProto with input_ids and attention_mask")
    logits = model(
        input_ids=td["input_ids"],
        attention_mask=td["attention_mask"],
        position_ids=td["position_ids"],
    ).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, td["input_ids"][:, 1:, None])
    return torch.nn.functional.pad(picked.squeeze(-1), (1, 0))


def policy_loss(
    logprobs: torch.Tensor, batch: DataProto, advantages: torch.Tensor, clip: float = 0.2
) -> torch.Tensor:
    """PPO-clipped policy gradient over response tokens, mean over tokens.

    Ratios are taken against the engine's ``infer_logprobs`` (the behaviour policy),
    so off-policy tokens from a previous version are corrected.
    """
    td = batch.batch
    if td is None:
        raise ValueError("policy_loss needs a DataProto with response_mask and infer_logprobs")
    mask = td["response_mask"].float()
    ratio = torch.exp(logprobs - td["infer_logprobs"].float())
    adv = advantages[:, None]
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    return -(objective * mask).sum() / mask.sum().clamp(min=1.0)
