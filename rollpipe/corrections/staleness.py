"""How stale a batch is, and weights or masks by the age of each token.

A response token's age is how many policy versions it is behind the trainer:
``current_version - policy_versions`` (the version that generated it, per token in the
rows). ``current_version=None`` takes the newest version in the batch, which measures the
spread of versions but not how far the whole batch lags: pass the trainer's version.
Tokens of an unknown version (``policy_versions < 0`` on a response token) count as age 0.
"""

from __future__ import annotations

import torch

from rollpipe.data.proto import DataProto


def _fields(batch: DataProto, caller: str) -> tuple[torch.Tensor, torch.Tensor]:
    td = batch.batch
    if td is None or "policy_versions" not in td or "response_mask" not in td:
        raise ValueError(f"{caller} needs a DataProto with policy_versions and response_mask")
    return td["policy_versions"].long(), td["response_mask"].bool()


def versions_behind(batch: DataProto, current_version: int | None = None) -> torch.Tensor:
    """Each response token's age in versions (int64 ``[B, T]``), 0 off the response."""
    versions, response = _fields(batch, "versions_behind")
    known = response & (versions >= 0)
    newest = int(versions[known].max()) if known.any() else 0
    current = newest if current_version is None else current_version
    if current < newest:
        raise ValueError(
            f"versions_behind: current_version={current_version} is older than a token of the "
            f"batch (version {newest}); pass the trainer's current policy version"
        )
    return torch.where(known, current - versions, 0)


def staleness_weights(
    batch: DataProto, staleness_decay: float, current_version: int | None = None
) -> torch.Tensor:
    """``staleness_decay ** age`` per response token (float32 ``[B, T]``), 0 off the
    response: with 0.5 a token one version old counts half, two versions a quarter."""
    if not 0 < staleness_decay <= 1:
        raise ValueError(
            f"staleness_weights: staleness_decay must be in (0, 1], not {staleness_decay}"
        )
    _, response = _fields(batch, "staleness_weights")
    age = versions_behind(batch, current_version).float()
    return torch.where(response, torch.pow(staleness_decay, age), 0.0)


def staleness_mask(
    batch: DataProto, max_staleness: int, current_version: int | None = None
) -> torch.Tensor:
    """The response tokens at most ``max_staleness`` versions behind (bool ``[B, T]``): the
    token-level form of the pipeline's group rule (``rollpipe.nodes.group_rules.is_stale``)."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(
            f"staleness_mask: max_staleness must be an int >= 0, not {max_staleness!r}"
        )
    _, response = _fields(batch, "staleness_mask")
    return response & (versions_behind(batch, current_version) <= max_staleness)


def staleness_metrics(batch: DataProto, current_version: int | None = None) -> dict[str, float]:
    """How stale the batch is, over its response tokens.

    ``staleness/versions_behind_mean`` and ``_max`` (token age), ``staleness/current_version``
    and, for each age present, ``staleness/tokens_{age}_behind``: that age's share of the
    tokens (the shares sum to 1).
    """
    _, response = _fields(batch, "staleness_metrics")
    age = versions_behind(batch, current_version)[response]
    versions = batch.batch["policy_versions"][response]  # type: ignore[index]
    known = versions[versions >= 0]
    current = (
        current_version if current_version is not None else (int(known.max()) if len(known) else 0)
    )
    metrics = {"staleness/current_version": float(current)}
    if not len(age):
        return {
            **metrics,
            "staleness/versions_behind_mean": 0.0,
            "staleness/versions_behind_max": 0.0,
        }
    metrics["staleness/versions_behind_mean"] = float(age.double().mean())
    metrics["staleness/versions_behind_max"] = float(age.max())
    ages, counts = torch.unique(age, return_counts=True)
    for a, c in zip(ages.tolist(), counts.tolist(), strict=True):
        metrics[f"staleness/tokens_{a}_behind"] = c / len(age)
    return metrics
