"""``Correction``: the off-policy corrections a trainer applies to one batch, as one frozen
record, and what applying it gives (``Corrected``: weights, a mask, metrics).

Each part is optional and each is computed on the batch's own ``response_mask`` (verl
and ROLL do this; SkyRL computes its sequence mask over the tokens its token masks kept).
The weights multiply: importance weights (``rollout_is``) times age weights
(``staleness_decay``). The masks intersect: token band, sequence band, outlier rows, age.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from rollpipe._utils.checks import float_in, int_at_least, one_of, optional
from rollpipe.corrections.gap import gap_metrics
from rollpipe.corrections.ratios import (
    IS_LEVELS,
    Threshold,
    importance_weights,
    parse_band,
    parse_threshold,
    sequence_mask,
    token_mask,
)
from rollpipe.corrections.staleness import staleness_mask, staleness_metrics, staleness_weights
from rollpipe.data.proto import DataProto


def _threshold(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    parse_threshold(value, f"{type(inst).__name__}.{attr.name}")


def _band(low: str, high: str) -> Any:
    """Both ends of a band, or neither (None), and ``0 <= low <= high``."""

    def check(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        pair = (getattr(inst, low), value)
        if (pair[0] is None) != (pair[1] is None):
            raise ValueError(
                f"{type(inst).__name__}: set both {low} and {high} or neither, got {pair}"
            )
        if pair[0] is not None:
            parse_band(f"{type(inst).__name__}.({low}, {high})", pair)

    return check


_number = float_in(0.0)


@attrs.frozen
class Corrected:
    """What a :class:`Correction` gives for one batch.

    ``weights`` (float ``[B, T]``) multiply each token's loss, 0 off the response;
    ``mask`` (bool ``[B, T]``) is the response tokens the loss keeps; ``metrics`` a flat
    ``name -> float`` dict (``rollout_corr/...`` and ``staleness/...``).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]


@attrs.frozen
class Correction:
    """Off-policy corrections, named as verl (``rollout_is*``) and SkyRL (masks) name them.

    Args:
        rollout_is: importance weights ``π_train / π_rollout`` at this level (``"token"``,
            ``"sequence"``, ``"geometric"``), or None for none.
        rollout_is_threshold: a number caps them (TIS); a ``(low, high)`` pair or
            ``"low_high"`` zeroes those outside the band (IcePop).
        token_mask_is_threshold_low, token_mask_is_threshold_high: tokens whose ratio
            leaves this band leave the loss (None, None: no token mask).
        sequence_mask_metric: ``"geometric"`` or ``"product"``: rows whose geometric mean
            (or product) of ratios leaves ``geo_mask_*`` (or ``product_mask_*``) leave the
            loss; None: no sequence mask.
        geo_mask_low, geo_mask_high, product_mask_low, product_mask_high: those bands
            (SkyRL's defaults).
        outlier_token_is_threshold_low, outlier_token_is_threshold_high: a row with one
            token whose ratio leaves this band leaves the loss (None, None: off).
        max_staleness: tokens more than this many versions behind leave the loss.
        staleness_decay: each token's weight is multiplied by ``staleness_decay ** age``.

    Examples:
        >>> from rollpipe.data.proto import DataProto
        >>> batch = DataProto.from_dict(tensors={
        ...     "response_mask": torch.tensor([[0, 1, 1, 1]]),
        ...     "infer_logprobs": torch.tensor([[0.0, -1.0, -1.0, -1.0]]),
        ...     "policy_versions": torch.tensor([[-1, 3, 3, 4]]),
        ... })
        >>> trainer = torch.tensor([[0.0, -0.5, -1.0, -3.0]])
        >>> fix = Correction(rollout_is="token", rollout_is_threshold=1.5, max_staleness=0)
        >>> out = fix.apply(trainer, batch, current_version=4)
        >>> out.weights
        tensor([[0.0000, 1.5000, 1.0000, 0.1353]])
        >>> out.mask
        tensor([[False, False, False,  True]])
    """

    rollout_is: str | None = attrs.field(default=None, validator=optional(one_of(*IS_LEVELS)))
    rollout_is_threshold: Threshold = attrs.field(default=2.0, validator=_threshold)
    token_mask_is_threshold_low: float | None = attrs.field(
        default=None, validator=optional(_number)
    )
    token_mask_is_threshold_high: float | None = attrs.field(
        default=None,
        validator=_band("token_mask_is_threshold_low", "token_mask_is_threshold_high"),
    )
    sequence_mask_metric: str | None = attrs.field(
        default=None, validator=optional(one_of("geometric", "product"))
    )
    geo_mask_low: float = attrs.field(default=0.99, validator=_number)
    geo_mask_high: float = attrs.field(
        default=1.01, validator=_band("geo_mask_low", "geo_mask_high")
    )
    product_mask_low: float = attrs.field(default=0.5, validator=_number)
    product_mask_high: float = attrs.field(
        default=2.0, validator=_band("product_mask_low", "product_mask_high")
    )
    outlier_token_is_threshold_low: float | None = attrs.field(
        default=None, validator=optional(_number)
    )
    outlier_token_is_threshold_high: float | None = attrs.field(
        default=None,
        validator=_band("outlier_token_is_threshold_low", "outlier_token_is_threshold_high"),
    )
    max_staleness: int | None = attrs.field(default=None, validator=optional(int_at_least(0)))
    staleness_decay: float | None = attrs.field(
        default=None, validator=optional(float_in(0.0, 1.0, low_open=True))
    )

    @property
    def uses_versions(self) -> bool:
        """Whether applying it reads ``policy_versions``."""
        return self.max_staleness is not None or self.staleness_decay is not None

    def apply(
        self, logprobs: torch.Tensor, batch: DataProto, current_version: int | None = None
    ) -> Corrected:
        """Weights, mask and metrics for ``batch`` given the trainer's ``logprobs`` (the
        policy before this update: verl's ``old_log_prob``) and its ``current_version``
        (None: the newest version in the batch; see ``rollpipe.corrections.staleness``)."""
        td = batch.batch
        if td is None:
            raise ValueError("Correction.apply needs a DataProto with tensors")
        weights = td["response_mask"].bool().float()
        if self.rollout_is is not None:
            level: Any = self.rollout_is
            weights = importance_weights(
                logprobs, batch, rollout_is=level, rollout_is_threshold=self.rollout_is_threshold
            )
        if self.staleness_decay is not None:
            weights = weights * staleness_weights(batch, self.staleness_decay, current_version)
        mask = self._ratio_mask(logprobs, batch)
        if self.max_staleness is not None:
            mask = mask & staleness_mask(batch, self.max_staleness, current_version)
        metrics = gap_metrics(logprobs, batch, mask)
        if self.uses_versions:
            metrics.update(staleness_metrics(batch, current_version))
        if self.rollout_is is not None:  # verl's: over every response token, masked or not
            given = weights[td["response_mask"].bool()]
            metrics["rollout_corr/rollout_is_mean"] = float(given.mean()) if len(given) else 0.0
        return Corrected(weights=weights, mask=mask, metrics=metrics)

    def _ratio_mask(self, logprobs: torch.Tensor, batch: DataProto) -> torch.Tensor:
        """The response tokens the token, sequence and outlier bands keep."""
        mask = batch.batch["response_mask"].bool()  # type: ignore[index]
        low: Any
        high: Any
        if self.token_mask_is_threshold_low is not None:
            low, high = self.token_mask_is_threshold_low, self.token_mask_is_threshold_high
            mask = mask & token_mask(logprobs, batch, low=low, high=high)
        if self.sequence_mask_metric is not None:
            metric: Any = self.sequence_mask_metric
            low, high = (
                (self.geo_mask_low, self.geo_mask_high)
                if metric == "geometric"
                else (self.product_mask_low, self.product_mask_high)
            )
            mask = mask & sequence_mask(
                logprobs, batch, sequence_mask_metric=metric, low=low, high=high
            )
        if self.outlier_token_is_threshold_low is not None:
            low, high = self.outlier_token_is_threshold_low, self.outlier_token_is_threshold_high
            mask = mask & sequence_mask(
                logprobs, batch, sequence_mask_metric="outlier", low=low, high=high
            )
        return mask
