"""rollpipe's batches through verl's own code (``nox -s compat`` installs verl).

A real pipeline batch (the vLLM engine and the tiny model) goes through ``to_verl()``,
then through what verl's PPO trainer does with an agent-loop batch: ``extract_reward``
(``rm_scores`` -> token-level scores), ``compute_advantage`` with GRPO (grouping by
``uid``), the vanilla PPO policy loss on the policy's log-probs against
``rollout_log_probs``, and ``compute_data_metrics``. The advantages and the loss must equal
rollpipe's own ``rollpipe.grpo`` on the native batch.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compat.cases import pipeline_batch, rescored
from transformers import AutoModelForCausalLM
from verl.protocol import DataProto as VerlDataProto
from verl.trainer.ppo.core_algos import (
    AdvantageEstimator,
    compute_grpo_outcome_advantage,
    compute_policy_loss_vanilla,
)
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.ray_trainer import compute_advantage, compute_response_mask
from verl.trainer.ppo.reward import extract_reward
from verl.workers.config import ActorConfig

from rollpipe.data.proto import DataProto
from rollpipe.grpo import group_advantages, policy_loss, token_logprobs


@pytest.fixture(scope="module")
def native(vllm_engine: Any, tokenizer: Any) -> DataProto:
    batch, _ = pipeline_batch(vllm_engine, tokenizer, num_groups=4, batch_size=16)
    return rescored(batch, seed=1)  # the pipeline's tokens, rewards that differ in a group


def as_trainer_sees_it(native: DataProto) -> VerlDataProto:
    """``to_verl()``, then the trainer's reward step (``use_kl_in_reward=False``)."""
    data = native.to_verl()
    reward, extra = extract_reward(data)
    assert extra == {}
    data.batch["token_level_scores"] = reward
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    return data


def row_values(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The one advantage of each row (GRPO broadcasts it over the response mask)."""
    per_row = (advantages * mask).sum(-1) / mask.sum(-1)
    assert torch.allclose(advantages, per_row[:, None] * mask)
    return per_row


def test_to_verl_is_a_consistent_verl_dataproto(native):
    data = native.to_verl()
    assert isinstance(data, VerlDataProto)
    data.check_consistency()
    assert len(data) == len(native)
    # verl's own reading of the layout: the response part of attention_mask
    response_attention = compute_response_mask(data)
    width = data.batch["responses"].shape[1]
    assert torch.equal(response_attention, data.batch["attention_mask"][:, -width:])
    assert not (data.batch["response_mask"].bool() & ~response_attention.bool()).any()
    # verl's row operations keep it whole
    halves = data.chunk(2)
    assert torch.equal(VerlDataProto.concat(halves).batch["input_ids"], data.batch["input_ids"])
    picked = data.select(batch_keys=["responses"], non_tensor_batch_keys=["uid"])
    assert set(picked.batch.keys()) == {"responses"}


def test_verl_grpo_advantage_is_rollpipes_group_advantage(native):
    data = compute_advantage(as_trainer_sees_it(native), AdvantageEstimator.GRPO)
    mask = data.batch["response_mask"]
    assert data.batch["advantages"].shape == mask.shape
    verl_rows = row_values(data.batch["advantages"], mask)
    scores, groups = native.batch["scores"].sum(-1), native.batch["traj_group_id"]
    ours = group_advantages(scores, groups)
    assert ours.abs().max() > 0.5  # the groups' scores differ
    assert torch.allclose(verl_rows, ours, atol=1e-5), (verl_rows - ours).abs().max()
    # Dr. GRPO: centred only
    rewards, uid = data.batch["token_level_rewards"], data.non_tensor_batch["uid"]
    centred, _ = compute_grpo_outcome_advantage(rewards, mask, uid, norm_adv_by_std_in_grpo=False)
    expected = group_advantages(scores, groups, scale=False)
    assert torch.allclose(row_values(centred, mask), expected, atol=1e-5)


def test_verl_policy_loss_is_rollpipes_policy_loss(native, tiny_model_path: Path):
    data = compute_advantage(as_trainer_sees_it(native), AdvantageEstimator.GRPO)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), torch_dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():  # a policy a little off the one that generated: ratios != 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    td = data.batch
    with torch.no_grad():
        inputs = {k: td[k] for k in ("input_ids", "attention_mask", "position_ids")}
        logits = model(**inputs).logits.float()
        prompt = td["prompts"].shape[1]
        log_softmax = torch.log_softmax(logits[:, prompt - 1 : -1], dim=-1)
        verl_logprobs = log_softmax.gather(-1, td["responses"][..., None]).squeeze(-1)
        native_logprobs = token_logprobs(model, native)
    generated, native_generated = td["response_mask"].bool(), native.batch["response_mask"]
    # the same policy log-probs from both layouts: prompts, positions and masks agree
    assert torch.allclose(verl_logprobs[generated], native_logprobs[native_generated], atol=1e-4)
    advantages = group_advantages(native.batch["scores"].sum(-1), native.batch["traj_group_id"])
    ours = policy_loss(native_logprobs, native, advantages, clip=0.2)
    losses = {}
    for dual_clip in (3.0, 1e9):  # verl's default dual-clip bound, and none (rollpipe has none)
        config = ActorConfig(
            strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=4, clip_ratio_c=dual_clip
        )
        losses[dual_clip], metrics = compute_policy_loss_vanilla(
            old_log_prob=td["rollout_log_probs"],
            log_prob=verl_logprobs,
            advantages=td["advantages"],
            response_mask=td["response_mask"],
            loss_agg_mode="token-mean",
            config=config,
        )
        assert metrics["actor/pg_clipfrac"] > 0  # PPO clipping is exercised
    assert torch.isclose(losses[1e9], ours, atol=1e-5), (losses[1e9].item(), ours.item())
    # the dual clip only caps the loss of negative-advantage tokens with ratio > 3
    assert losses[3.0] <= ours + 1e-6


def test_verl_data_metrics_read_the_batch(native):
    data = compute_advantage(as_trainer_sees_it(native), AdvantageEstimator.GRPO)
    metrics = compute_data_metrics(copy.deepcopy(data), use_critic=False)
    scores = native.batch["scores"].sum(-1)
    assert metrics["critic/score/mean"] == pytest.approx(scores.mean().item(), abs=1e-5)
    prompt_lengths = native.batch["prompt_mask"].sum(-1).float()
    lengths = native.batch["attention_mask"].sum(-1).float()
    response_lengths = lengths - prompt_lengths
    assert metrics["response_length/mean"] == pytest.approx(response_lengths.mean().item())
    assert metrics["prompt_length/mean"] == pytest.approx(prompt_lengths.mean().item())
    assert np.isfinite(metrics["critic/advantages/mean"])
