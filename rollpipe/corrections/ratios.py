"""Importance weights and masks from the trainer/rollout log-ratio of each response token.

``log_ratio = logprobs - infer_logprobs`` (``log(π_train / π_rollout)``) on the
``response_mask`` tokens of a batch. Weights reweight a token's loss (truncated
importance sampling, TIS); masks remove tokens or whole rows from it (rejection). Every
exponent is taken of a log-ratio clamped to ``±SAFETY_BOUND`` (verl's and SkyRL's 20),
so no ratio overflows. Weights and masks carry no gradient.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from rollpipe.data.proto import DataProto

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (verl's ``SAFETY_BOUND``)."""

IS_LEVELS = ("token", "sequence", "geometric")
SEQUENCE_MASK_METRICS = ("geometric", "product", "outlier")

Threshold = float | tuple[float, float] | str


def _fields(batch: DataProto, caller: str) -> tuple[torch.Tensor, torch.Tensor]:
    td = batch.batch
    if td is None or "infer_logprobs" not in td or "response_mask" not in td:
        raise ValueError(f"{caller} needs a DataProto with infer_logprobs and response_mask")
    return td["infer_logprobs"].float(), td["response_mask"].bool()


def log_ratio(logprobs: torch.Tensor, batch: DataProto) -> torch.Tensor:
    """``logprobs - infer_logprobs`` on response tokens, 0 elsewhere (float32, detached).

    ``logprobs`` is the trainer's log-probability of each row token, aligned with the
    batch's columns (what ``rollpipe.grpo.token_logprobs`` returns).
    """
    infer, response = _fields(batch, "log_ratio")
    if logprobs.shape != infer.shape:
        raise ValueError(
            f"log_ratio: logprobs {tuple(logprobs.shape)} must have the shape of the batch's "
            f"infer_logprobs {tuple(infer.shape)}"
        )
    return torch.where(response, logprobs.detach().float() - infer, 0.0)


def _row_sum(values: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    return torch.where(response, values, 0.0).sum(-1, keepdim=True)


def _row_mean(values: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    count = response.sum(-1, keepdim=True).clamp(min=1)
    return _row_sum(values, response) / count


def parse_band(name: str, band: tuple[float, float] | str) -> tuple[float, float]:
    """``(low, high)`` from a pair or verl's ``"low_high"`` string, checked."""
    if isinstance(band, str):
        parts = band.strip().split("_")
        try:
            low, high = (float(p) for p in parts)
        except ValueError:
            raise ValueError(
                f"{name}: {band!r} is not 'low_high' (two numbers joined by '_', e.g. '0.5_2.0')"
            ) from None
    elif len(band) == 2:
        low, high = float(band[0]), float(band[1])
    else:
        raise ValueError(f"{name}: {band!r} must be a (low, high) pair")
    if not 0 <= low <= high:
        raise ValueError(f"{name}: the band ({low}, {high}) needs 0 <= low <= high")
    return low, high


def parse_threshold(
    threshold: Threshold, name: str = "importance_weights: rollout_is_threshold"
) -> tuple[float | None, float]:
    """verl's ``rollout_is_threshold``: a number (or numeric string) is a TIS cap,
    ``(None, cap)``; a pair or ``"low_high"`` string is an IcePop band ``(low, high)``."""
    if isinstance(threshold, str) and "_" not in threshold:
        try:
            threshold = float(threshold)
        except ValueError:
            raise ValueError(f"{name}: {threshold!r} is neither a number nor 'low_high'") from None
    if isinstance(threshold, bool) or not isinstance(threshold, int | float | str | tuple | list):
        raise TypeError(f"{name}: {threshold!r} must be a number, a (low, high) pair or 'low_high'")
    if isinstance(threshold, int | float):
        if not threshold > 0:
            raise ValueError(f"{name}: a cap must be > 0, not {threshold}")
        return None, float(threshold)
    return parse_band(name, threshold)


def _in_band(log_values: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``low <= exp(log_values) <= high``, compared in log space (exact at the clamp)."""
    low_log, high_log = (-math.inf if b == 0 else math.log(b) for b in (low, high))
    return (log_values >= low_log) & (log_values <= high_log)


def importance_weights(
    logprobs: torch.Tensor,
    batch: DataProto,
    *,
    rollout_is: Literal["token", "sequence", "geometric"] = "token",
    rollout_is_threshold: Threshold = 2.0,
) -> torch.Tensor:
    """Truncated importance weights ``π_train / π_rollout`` per token ``[B, T]``, 0 off
    the response (verl's ``compute_rollout_correction_weights``).

    ``rollout_is`` (verl's name) is the level: ``"token"`` one ratio per token,
    ``"sequence"`` the product of the row's ratios, ``"geometric"`` their geometric mean
    (ROLL's ``weight_type="geometric"``), broadcast over the row. ``rollout_is_threshold``:
    a number caps the weights (TIS, ``clamp(max=...)``); a ``(low, high)`` pair or
    ``"low_high"`` string zeroes the weights outside the band and keeps the rest (IcePop,
    as verl reads such a string).
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(
            f"importance_weights: rollout_is must be one of {IS_LEVELS}, not {rollout_is!r}"
        )
    ratio_log = log_ratio(logprobs, batch)
    _, response = _fields(batch, "importance_weights")
    if rollout_is == "sequence":
        ratio_log = _row_sum(ratio_log, response).expand_as(ratio_log)
    elif rollout_is == "geometric":
        ratio_log = _row_mean(ratio_log, response).expand_as(ratio_log)
    ratio_log = ratio_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    weights = torch.where(response, ratio_log.exp(), 0.0)
    low, high = parse_threshold(rollout_is_threshold)
    if low is None:
        return weights.clamp(max=high)
    return torch.where(response & _in_band(ratio_log, low, high), weights, 0.0)


def token_mask(
    logprobs: torch.Tensor, batch: DataProto, *, low: float, high: float
) -> torch.Tensor:
    """The response tokens whose ratio ``π_train / π_rollout`` lies in ``[low, high]``
    (bool ``[B, T]``): the rest leave the loss (IcePop-style rejection; SkyRL's
    ``token_mask_is_threshold_low`` / ``_high``, ROLL's token filter ``ratio_low`` /
    ``ratio_high``)."""
    low, high = parse_band("token_mask: (low, high)", (low, high))
    ratio_log = log_ratio(logprobs, batch).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    _, response = _fields(batch, "token_mask")
    return response & _in_band(ratio_log, low, high)


def sequence_mask(
    logprobs: torch.Tensor,
    batch: DataProto,
    *,
    sequence_mask_metric: Literal["geometric", "product", "outlier"] = "geometric",
    low: float,
    high: float,
) -> torch.Tensor:
    """The response tokens of the rows whose ratio lies in ``[low, high]`` (bool ``[B, T]``):
    a row out of the band leaves the loss whole.

    ``sequence_mask_metric`` (SkyRL's name): ``"geometric"`` the geometric mean of the row's
    token ratios (SkyRL's ``geo_mask_low`` / ``_high``, ROLL's ``agg_type="geometric"``
    filter), ``"product"`` their product (SkyRL's ``product_mask_*``), ``"outlier"`` every
    token's own ratio (a row with one token out of the band goes: SkyRL's
    ``outlier_token_is_threshold_*``).
    """
    if sequence_mask_metric not in SEQUENCE_MASK_METRICS:
        raise ValueError(
            f"sequence_mask: sequence_mask_metric must be one of {SEQUENCE_MASK_METRICS}, "
            f"not {sequence_mask_metric!r}"
        )
    low, high = parse_band("sequence_mask: (low, high)", (low, high))
    ratio_log = log_ratio(logprobs, batch)
    _, response = _fields(batch, "sequence_mask")
    if sequence_mask_metric == "outlier":
        inside = _in_band(ratio_log.clamp(-SAFETY_BOUND, SAFETY_BOUND), low, high)
        keep = (inside | ~response).all(-1, keepdim=True)
    else:
        agg = _row_mean if sequence_mask_metric == "geometric" else _row_sum
        keep = _in_band(agg(ratio_log, response).clamp(-SAFETY_BOUND, SAFETY_BOUND), low, high)
    return response & keep
