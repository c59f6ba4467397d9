"""Off-policy corrections on a batch: train-vs-rollout importance weights (TIS, IcePop),
token and sequence masks from the ratio, weights and masks by token age, and the metrics
of the gap and of staleness. See ``docs/off-policy.md``.

The functions read the rows' ``infer_logprobs``, ``response_mask`` and ``policy_versions``
and take the trainer's log-probabilities aligned with the rows
(``rollpipe.grpo.token_logprobs``); :class:`Correction` bundles them for
``rollpipe.grpo.grpo_step(..., correction=...)``.
"""

from rollpipe.corrections.correction import Corrected, Correction
from rollpipe.corrections.gap import gap_metrics
from rollpipe.corrections.ratios import (
    SAFETY_BOUND,
    importance_weights,
    log_ratio,
    sequence_mask,
    token_mask,
)
from rollpipe.corrections.staleness import (
    staleness_mask,
    staleness_metrics,
    staleness_weights,
    versions_behind,
)

__all__ = [
    "SAFETY_BOUND",
    "Corrected",
    "Correction",
    "gap_metrics",
    "importance_weights",
    "log_ratio",
    "sequence_mask",
    "staleness_mask",
    "staleness_metrics",
    "staleness_weights",
    "token_mask",
    "versions_behind",
]
