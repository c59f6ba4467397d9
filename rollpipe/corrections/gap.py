"""The train-vs-rollout gap of a batch: how far the trainer's log-probabilities are from
the engine's on the response tokens, and how many tokens a correction removed.

Keys carry verl's ``rollout_corr/`` prefix; ``kl`` and ``k3_kl`` are verl's (from
``compute_offpolicy_metrics``), the rest are rollpipe's.
"""

from __future__ import annotations

import torch

from rollpipe.corrections.ratios import SAFETY_BOUND, log_ratio
from rollpipe.data.proto import DataProto


def gap_metrics(
    logprobs: torch.Tensor, batch: DataProto, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """The gap between ``logprobs`` (trainer) and ``infer_logprobs`` (engine).

    - ``rollout_corr/logprob_abs_diff_mean`` / ``_max``: mean and max ``|Δ log p|`` per token;
    - ``rollout_corr/kl``: mean ``infer - trainer`` (verl's KL(π_rollout || π_train) estimate);
    - ``rollout_corr/k3_kl``: mean ``r - log r - 1`` with ``r = π_train / π_rollout`` (>= 0);
    - ``rollout_corr/masked_fraction``: share of response tokens outside ``mask`` (the mask a
      correction keeps; 0 without one);
    - ``rollout_corr/response_tokens``: how many tokens these figures cover.
    """
    diff = log_ratio(logprobs, batch)
    response = batch.batch["response_mask"].bool()  # type: ignore[index]
    tokens = diff[response].double()
    figures = {"rollout_corr/response_tokens": float(len(tokens))}
    if mask is not None and mask.shape != response.shape:
        raise ValueError(
            f"gap_metrics: mask {tuple(mask.shape)} must have the shape of the batch's "
            f"response_mask {tuple(response.shape)}"
        )
    removed = (response & ~mask.bool()).sum() if mask is not None else torch.tensor(0)
    if not len(tokens):
        zero = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl", "k3_kl", "masked_fraction")
        return {**figures, **{f"rollout_corr/{k}": 0.0 for k in zero}}
    safe = tokens.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    figures["rollout_corr/logprob_abs_diff_mean"] = float(tokens.abs().mean())
    figures["rollout_corr/logprob_abs_diff_max"] = float(tokens.abs().max())
    figures["rollout_corr/kl"] = float(-tokens.mean())
    figures["rollout_corr/k3_kl"] = float((safe.exp() - safe - 1).mean())
    figures["rollout_corr/masked_fraction"] = float(removed) / len(tokens)
    return figures
