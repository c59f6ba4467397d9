"""rollpipe's off-policy corrections against verl's own (``verl.trainer.ppo.
rollout_corr_helper``, installed by ``nox -s compat``), to 1e-6 on random batches.

verl works on response-only ``[B, R]`` tensors and rollpipe on whole rows with a
``response_mask``; both read only the masked tokens, so one random tensor pair (with
random response masks) serves both. verl's ``k1`` rejection options bound
``-log r = log(π_rollout / π_train)``: its ``"lo_hi"`` keeps ratios ``r`` in
``[1/hi, 1/lo]``, which is rollpipe's band ``(1/hi, 1/lo)``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
from verl.trainer.ppo.rollout_corr_helper import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from verl.workers.config import ActorConfig

from rollpipe.corrections import (
    Correction,
    gap_metrics,
    importance_weights,
    sequence_mask,
    token_mask,
)
from rollpipe.data.proto import DataProto
from rollpipe.grpo import policy_loss

TOL = {"atol": 1e-6, "rtol": 1e-6}


def random_case(seed: int, rows: int = 6, width: int = 12, spread: float = 0.3):
    """Trainer log-probs, and a batch whose engine log-probs differ by noise of ``spread``;
    every row has at least one response token (verl requires one in the batch)."""
    gen = torch.Generator().manual_seed(seed)
    response = torch.rand(rows, width, generator=gen) < 0.7
    response[:, 0] = True
    infer = -3 * torch.rand(rows, width, generator=gen)
    trainer = infer + spread * torch.randn(rows, width, generator=gen)
    infer, trainer = (torch.where(response, t, 0.0) for t in (infer, trainer))
    batch = DataProto.from_dict(tensors={"response_mask": response, "infer_logprobs": infer})
    return trainer, batch


def verl_inputs(trainer: torch.Tensor, batch: DataProto):
    td = batch.batch
    return trainer - td["infer_logprobs"], td["response_mask"].float()


seeds = st.integers(0, 2**31 - 1)
spreads = st.sampled_from([0.01, 0.3, 2.0])


@settings(max_examples=40, deadline=None)
@given(seeds, spreads, st.sampled_from(["token", "sequence"]), st.sampled_from([1.5, 2.0, 5.0]))
def test_tis_weights_are_verls(seed, spread, level, cap):
    trainer, batch = random_case(seed, spread=spread)
    theirs, _ = compute_rollout_correction_weights(
        *verl_inputs(trainer, batch), rollout_is=level, rollout_is_threshold=cap
    )
    ours = importance_weights(trainer, batch, rollout_is=level, rollout_is_threshold=cap)
    torch.testing.assert_close(ours, theirs.float(), **TOL)


@settings(max_examples=40, deadline=None)
@given(
    seeds, spreads, st.sampled_from(["token", "sequence"]), st.sampled_from(["0.5_2.0", "0.8_1.25"])
)
def test_icepop_weights_are_verls(seed, spread, level, band):
    trainer, batch = random_case(seed, spread=spread)
    ours = importance_weights(trainer, batch, rollout_is=level, rollout_is_threshold=band)
    try:
        theirs, metrics = compute_rollout_correction_weights(
            *verl_inputs(trainer, batch), rollout_is=level, rollout_is_threshold=band
        )
    except ZeroDivisionError:  # verl's effective sample size when IcePop zeroes every weight
        assert not ours.any()
        return
    torch.testing.assert_close(ours, theirs.float(), **TOL)
    assert "rollout_is_oob_ratio" in metrics


@pytest.mark.parametrize(
    ("option", "metric"),
    [("token_k1", None), ("seq_mean_k1", "geometric"), ("seq_sum_k1", "product")],
)
@settings(max_examples=30, deadline=None)
@given(seed=seeds, spread=spreads, band=st.sampled_from([(0.5, 2.0), (0.7, 1.3), (0.95, 1.02)]))
def test_band_masks_are_verls_k1_rejection(option, metric, seed, spread, band):
    trainer, batch = random_case(seed, spread=spread)
    lo, hi = band
    theirs, metrics = compute_rollout_rejection_mask(
        *verl_inputs(trainer, batch), rollout_rs=option, rollout_rs_threshold=f"{lo}_{hi}"
    )
    if metric is None:
        ours = token_mask(trainer, batch, low=1 / hi, high=1 / lo)
    else:
        ours = sequence_mask(trainer, batch, sequence_mask_metric=metric, low=1 / hi, high=1 / lo)
    assert torch.equal(ours, theirs.bool())
    figures = gap_metrics(trainer, batch, ours)
    masked = figures["rollout_corr/masked_fraction"]
    assert masked == pytest.approx(metrics["rollout_rs_masked_fraction"], abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(seeds, spreads)
def test_gap_kl_is_verls(seed, spread):
    trainer, batch = random_case(seed, spread=spread)
    td = batch.batch
    theirs = compute_offpolicy_metrics(trainer, td["infer_logprobs"], td["response_mask"].float())
    ours = gap_metrics(trainer, batch)
    for key in ("kl", "k3_kl"):
        assert ours[f"rollout_corr/{key}"] == pytest.approx(theirs[key], abs=1e-6, rel=1e-5)


@settings(max_examples=30, deadline=None)
@given(seeds, spreads)
def test_correction_and_decoupled_loss_are_verls(seed, spread):
    """Token TIS and a geometric row mask through verl's one entry point, then verl's PPO
    loss in decoupled mode (ratio against ``old_log_prob``, times the IS weights, over the
    rejection mask): rollpipe's ``Correction`` and ``policy_loss`` give the same."""
    old, batch = random_case(seed, spread=spread)
    gen = torch.Generator().manual_seed(seed + 1)
    current = old + 0.1 * torch.randn(old.shape, generator=gen)
    advantages = torch.randn(len(batch), generator=gen)
    td = batch.batch
    weights, verl_mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old,
        rollout_log_prob=td["infer_logprobs"],
        response_mask=td["response_mask"].float(),
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.8_1.25",
    )
    fix = Correction(
        rollout_is="token", sequence_mask_metric="geometric", geo_mask_low=0.8, geo_mask_high=1.25
    )
    ours = fix.apply(old, batch)
    assert weights is not None
    torch.testing.assert_close(ours.weights, weights.batch["rollout_is_weights"].float(), **TOL)
    assert torch.equal(ours.mask, verl_mask.bool())
    for key in ("rollout_is_mean", "rollout_rs_masked_fraction", "kl"):
        mine = key.replace("rollout_rs_", "")
        assert ours.metrics[f"rollout_corr/{mine}"] == pytest.approx(
            metrics[f"rollout_corr/{key}"], abs=1e-6, rel=1e-5
        )
    if not ours.mask.any():
        return
    config = ActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, clip_ratio_c=1e9
    )
    theirs, _ = compute_policy_loss_vanilla(
        old_log_prob=old,
        log_prob=current,
        advantages=advantages[:, None].expand_as(old),
        response_mask=verl_mask,
        loss_agg_mode="token-mean",
        config=config,
        rollout_is_weights=weights.batch["rollout_is_weights"],
    )
    loss = policy_loss(
        current, batch, advantages, old_logprobs=old, weights=ours.weights, mask=ours.mask
    )
    assert float(loss) == pytest.approx(float(theirs), abs=1e-6, rel=1e-5)
