"""Off-policy corrections (``rollpipe.corrections``): each function on a hand-computed
batch, properties that hold for any batch, and ``grpo_step(correction=...)``.

The hand batch (two rows, three response tokens each) has trainer-minus-engine
log-ratios ``[0.5, 0, -2]`` and ``[0, 0.5, -0.25]``, so ratios ``e^0.5 = 1.6487``,
``1`` and ``e^-2 = 0.1353`` in row 0 and ``1``, ``1.6487``, ``e^-0.25 = 0.7788`` in row 1.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.corrections import (
    Correction,
    gap_metrics,
    importance_weights,
    log_ratio,
    sequence_mask,
    staleness_mask,
    staleness_metrics,
    staleness_weights,
    token_mask,
    versions_behind,
)
from rollpipe.data.proto import DataProto
from rollpipe.grpo import grpo_step, policy_loss, token_logprobs

E = math.exp


def hand_batch() -> tuple[torch.Tensor, DataProto]:
    response = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    infer = torch.tensor([[0.0, -1, -1, -1, 0], [0, 0, -2, -2, -2]])
    trainer = torch.tensor([[-7.0, -0.5, -1, -3, -7], [-7, -7, -2, -1.5, -2.25]])
    versions = torch.tensor([[-1, 3, 3, 4, -1], [-1, -1, 4, 4, 4]])
    tensors = {"response_mask": response, "infer_logprobs": infer, "policy_versions": versions}
    return trainer, DataProto.from_dict(tensors=tensors)


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-6, rtol=1e-6)


def test_log_ratio_is_trainer_minus_engine_on_response_tokens_only():
    trainer, batch = hand_batch()
    close(log_ratio(trainer, batch), [[0, 0.5, 0, -2, 0], [0, 0, 0, 0.5, -0.25]])


def test_token_tis_caps_each_ratio():
    trainer, batch = hand_batch()
    weights = importance_weights(trainer, batch, rollout_is="token", rollout_is_threshold=1.5)
    close(weights, [[0, 1.5, 1, E(-2), 0], [0, 0, 1, 1.5, E(-0.25)]])


def test_sequence_and_geometric_weights_are_one_per_row():
    trainer, batch = hand_batch()
    seq = importance_weights(trainer, batch, rollout_is="sequence", rollout_is_threshold=1.2)
    close(seq, [[0, E(-1.5), E(-1.5), E(-1.5), 0], [0, 0, 1.2, 1.2, 1.2]])  # e^0.25 capped
    geo = importance_weights(trainer, batch, rollout_is="geometric", rollout_is_threshold=5)
    g0, g1 = E(-1.5 / 3), E(0.25 / 3)
    close(geo, [[0, g0, g0, g0, 0], [0, 0, g1, g1, g1]])


@pytest.mark.parametrize("band", ["0.5_1.5", (0.5, 1.5)])
def test_icepop_zeroes_weights_outside_the_band(band):
    trainer, batch = hand_batch()
    weights = importance_weights(trainer, batch, rollout_is_threshold=band)
    close(weights, [[0, 0, 1, 0, 0], [0, 0, 1, 0, E(-0.25)]])


def test_token_mask_keeps_tokens_inside_the_band():
    trainer, batch = hand_batch()
    mask = token_mask(trainer, batch, low=0.5, high=1.5)
    assert mask.tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 0, 1]]


@pytest.mark.parametrize(
    ("metric", "low", "high", "kept_rows"),
    [
        ("geometric", 0.5, 1.1, [0, 1]),  # e^-0.5 = 0.61, e^0.083 = 1.09
        ("geometric", 0.7, 1.1, [1]),
        ("product", 0.5, 2.0, [1]),  # e^-1.5 = 0.22, e^0.25 = 1.28
        ("outlier", 0.1, 2.0, [0, 1]),  # every token in [0.1, 2]
        ("outlier", 0.2, 2.0, [1]),  # row 0 has e^-2 = 0.135
    ],
)
def test_sequence_masks_keep_or_drop_whole_rows(metric, low, high, kept_rows):
    trainer, batch = hand_batch()
    mask = sequence_mask(trainer, batch, sequence_mask_metric=metric, low=low, high=high)
    response = batch.batch["response_mask"]
    for row in range(2):
        expected = response[row] if row in kept_rows else torch.zeros_like(response[row])
        assert mask[row].tolist() == expected.tolist()


def test_gap_metrics_by_hand():
    trainer, batch = hand_batch()
    keep = token_mask(trainer, batch, low=0.5, high=1.5)
    figures = gap_metrics(trainer, batch, keep)
    k3 = [E(0.5) - 1.5, 0, E(-2) + 1, 0, E(0.5) - 1.5, E(-0.25) - 0.75]
    assert figures == pytest.approx(
        {
            "rollout_corr/response_tokens": 6,
            "rollout_corr/logprob_abs_diff_mean": 3.25 / 6,
            "rollout_corr/logprob_abs_diff_max": 2.0,
            "rollout_corr/kl": 1.25 / 6,
            "rollout_corr/k3_kl": sum(k3) / 6,
            "rollout_corr/masked_fraction": 3 / 6,
        }
    )


def test_ages_weights_masks_and_staleness_metrics_by_hand():
    _, batch = hand_batch()
    assert versions_behind(batch, 5).tolist() == [[0, 2, 2, 1, 0], [0, 0, 1, 1, 1]]
    assert versions_behind(batch).tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]  # newest: 4
    close(staleness_weights(batch, 0.5, 5), [[0, 0.25, 0.25, 0.5, 0], [0, 0, 0.5, 0.5, 0.5]])
    assert staleness_mask(batch, 1, 5).tolist() == [[0, 0, 0, 1, 0], [0, 0, 1, 1, 1]]
    assert staleness_metrics(batch, 5) == pytest.approx(
        {
            "staleness/current_version": 5,
            "staleness/versions_behind_mean": 8 / 6,
            "staleness/versions_behind_max": 2,
            "staleness/tokens_1_behind": 4 / 6,
            "staleness/tokens_2_behind": 2 / 6,
        }
    )


def test_correction_combines_weights_and_masks():
    trainer, batch = hand_batch()
    fix = Correction(
        rollout_is="token",
        rollout_is_threshold=1.5,
        token_mask_is_threshold_low=0.1,
        token_mask_is_threshold_high=1.6,  # drops the two e^0.5 tokens
        staleness_decay=0.5,
        max_staleness=1,  # drops row 0's two tokens of version 3
    )
    out = fix.apply(trainer, batch, current_version=5)
    close(out.weights, [[0, 0.375, 0.25, 0.5 * E(-2), 0], [0, 0, 0.5, 0.75, 0.5 * E(-0.25)]])
    assert out.mask.tolist() == [[0, 0, 0, 1, 0], [0, 0, 1, 0, 1]]
    assert out.metrics["rollout_corr/masked_fraction"] == pytest.approx(3 / 6)
    assert out.metrics["staleness/versions_behind_max"] == 2


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"rollout_is": "tokens"}, "Correction.rollout_is"),
        ({"rollout_is_threshold": 0}, "rollout_is_threshold"),
        ({"rollout_is_threshold": "2_1"}, "rollout_is_threshold"),
        ({"rollout_is_threshold": "a_b"}, "rollout_is_threshold"),
        ({"token_mask_is_threshold_low": 0.5}, "token_mask_is_threshold_high"),
        ({"geo_mask_low": 1.2}, "geo_mask_high"),
        ({"max_staleness": -1}, "Correction.max_staleness"),
        ({"staleness_decay": 0}, "Correction.staleness_decay"),
        ({"sequence_mask_metric": "outlier"}, "Correction.sequence_mask_metric"),
    ],
)
def test_bad_settings_name_the_field(kwargs, names):
    with pytest.raises(ValueError, match=names):
        Correction(**kwargs)


def test_errors_name_the_argument_and_value():
    trainer, batch = hand_batch()
    with pytest.raises(ValueError, match="current_version=3 is older"):
        versions_behind(batch, 3)
    with pytest.raises(ValueError, match="logprobs \\(2, 4\\)"):
        log_ratio(trainer[:, :4], batch)
    with pytest.raises(ValueError, match="rollout_is must be one of"):
        importance_weights(trainer, batch, rollout_is="row")  # type: ignore[arg-type]
    bare = DataProto.from_dict(tensors={"response_mask": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="infer_logprobs"):
        token_mask(torch.zeros(1, 2), bare, low=0.5, high=2)
    with pytest.raises(ValueError, match="policy_versions"):
        staleness_metrics(bare)


# -- properties: any batch ---------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn, same: bool = False) -> tuple[torch.Tensor, DataProto]:
    rows, width = draw(st.integers(1, 5)), draw(st.integers(1, 8))
    n = rows * width
    flags = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    values = st.floats(-30, 0, allow_nan=False, width=32)
    infer = draw(st.lists(values, min_size=n, max_size=n))
    trainer = infer if same else draw(st.lists(values, min_size=n, max_size=n))
    versions = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    response = torch.tensor(flags).view(rows, width)
    tensors = {
        "response_mask": response,
        "infer_logprobs": torch.where(response, torch.tensor(infer).view(rows, width), 0.0),
        "policy_versions": torch.where(response, torch.tensor(versions).view(rows, width), -1),
    }
    return torch.tensor(trainer).view(rows, width), DataProto.from_dict(tensors=tensors)


bands = st.tuples(st.floats(0, 3), st.floats(0, 3)).map(lambda b: (min(b), max(b)))
levels = st.sampled_from(["token", "sequence", "geometric"])


@settings(max_examples=80, deadline=None)
@given(batches(), bands, st.sampled_from(["geometric", "product", "outlier"]), st.integers(0, 4))
def test_masks_only_ever_remove_response_tokens(case, band, metric, max_staleness):
    trainer, batch = case
    response = batch.batch["response_mask"]
    low, high = band
    for mask in (
        token_mask(trainer, batch, low=low, high=high),
        sequence_mask(trainer, batch, sequence_mask_metric=metric, low=low, high=high),
        staleness_mask(batch, max_staleness, current_version=4),
        Correction(sequence_mask_metric="product", max_staleness=max_staleness)
        .apply(trainer, batch, current_version=4)
        .mask,
    ):
        assert mask.dtype == torch.bool
        assert not (mask & ~response).any()


@settings(max_examples=80, deadline=None)
@given(batches(), levels, st.floats(0.01, 10))
def test_tis_weights_are_in_zero_to_cap_and_zero_off_the_response(case, level, cap):
    trainer, batch = case
    weights = importance_weights(trainer, batch, rollout_is=level, rollout_is_threshold=cap)
    assert (weights >= 0).all() and (weights <= cap).all()
    assert (weights[~batch.batch["response_mask"]] == 0).all()


@settings(max_examples=80, deadline=None)
@given(batches(), levels, bands)
def test_icepop_weights_are_zero_or_inside_the_band(case, level, band):
    trainer, batch = case
    low, high = band
    weights = importance_weights(trainer, batch, rollout_is=level, rollout_is_threshold=band)
    kept = weights[weights != 0]
    assert ((kept >= low * (1 - 1e-6)) & (kept <= high * (1 + 1e-6))).all()


@settings(max_examples=80, deadline=None)
@given(batches(same=True), levels, st.floats(0.01, 1), st.floats(1, 10))
def test_identical_logprobs_need_no_correction(case, level, low, high):
    trainer, batch = case
    response = batch.batch["response_mask"]
    weights = importance_weights(trainer, batch, rollout_is=level, rollout_is_threshold=high)
    assert torch.equal(weights, response.float())
    fix = Correction(
        rollout_is=level,
        rollout_is_threshold=(low, high),
        token_mask_is_threshold_low=low,
        token_mask_is_threshold_high=high,
        sequence_mask_metric="geometric",
        outlier_token_is_threshold_low=low,
        outlier_token_is_threshold_high=high,
    )
    out = fix.apply(trainer, batch)
    assert torch.equal(out.weights, response.float())
    assert torch.equal(out.mask, response)
    assert out.metrics["rollout_corr/logprob_abs_diff_max"] == 0
    assert out.metrics["rollout_corr/masked_fraction"] == 0


# -- through grpo_step -------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_and_rows(tiny_model_path: Path):
    """The tiny policy and rows whose ``infer_logprobs`` are its own log-probabilities
    (the engine ran the trainer's weights), two of four rows generated a version ago."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = torch.randint(5, 200, (4, 10))
    response = torch.zeros(4, 10, dtype=torch.bool)
    response[:, 5:] = True
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.ones(4, 10, dtype=torch.int64),
        "position_ids": torch.arange(10).expand(4, 10).clone(),
        "response_mask": response,
        "infer_logprobs": torch.zeros(4, 10),
        "policy_versions": torch.where(response, torch.tensor([[6], [6], [7], [7]]), -1),
        "episode_scores": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "traj_group_id": torch.tensor([0, 0, 1, 1]),
    }
    batch = DataProto.from_dict(tensors=tensors)
    with torch.no_grad():
        own = token_logprobs(policy, batch)
    batch.batch["infer_logprobs"] = torch.where(response, own, 0.0)
    return policy, batch


def step(policy, batch, **kwargs):
    policy = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    figures = grpo_step(policy, optimizer, batch, max_grad_norm=None, **kwargs)
    return policy, figures


def test_grpo_step_without_gap_corrects_nothing(policy_and_rows):
    policy, batch = policy_and_rows
    _, plain = step(policy, batch)
    fix = Correction(
        rollout_is="token", token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2
    )
    _, fixed = step(policy, batch, correction=fix, mini_batch_size=2)
    assert "rollout_corr/kl" not in plain
    assert fixed["rollout_corr/logprob_abs_diff_max"] < 1e-4
    assert fixed["rollout_corr/masked_fraction"] == 0
    _, two_steps = step(policy, batch, mini_batch_size=2)
    assert fixed["loss"] == pytest.approx(two_steps["loss"], abs=1e-5)
    assert plain["loss"] == pytest.approx(step(policy, batch, correction=fix)[1]["loss"], abs=1e-5)


def test_grpo_step_masked_tokens_get_no_gradient(policy_and_rows):
    policy, batch = policy_and_rows
    moved, figures = step(policy, batch, correction=Correction(max_staleness=0), policy_version=8)
    assert figures["rollout_corr/masked_fraction"] == 1.0  # every token 1 or 2 versions old
    assert figures["staleness/tokens_1_behind"] == 0.5
    for before, after in zip(policy.parameters(), moved.parameters(), strict=True):
        assert torch.equal(before, after)
    _, kept = step(policy, batch, correction=Correction(max_staleness=1), policy_version=8)
    assert kept["rollout_corr/masked_fraction"] == 0.5


def test_policy_loss_weights_scale_and_mask_removes():
    trainer, batch = hand_batch()
    adv = torch.tensor([1.0, -1.0])
    plain = policy_loss(trainer, batch, adv)
    ones = torch.ones_like(trainer)
    assert policy_loss(trainer, batch, adv, weights=2 * ones) == pytest.approx(2 * float(plain))
    infer = batch.batch["infer_logprobs"]
    same = policy_loss(trainer, batch, adv, old_logprobs=infer, mask=batch.batch["response_mask"])
    assert float(same) == pytest.approx(float(plain))
    only_first = torch.zeros_like(trainer, dtype=torch.bool)
    only_first[0, 2] = True  # ratio 1, advantage 1: objective 1
    assert float(policy_loss(trainer, batch, adv, mask=only_first)) == pytest.approx(-1.0)
