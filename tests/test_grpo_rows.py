"""Proof that rollpipe's rows train a policy correctly, on a real vLLM batch.

The batch comes from the real pipeline on the session's vLLM engine (the tiny model,
float32), multi-turn, so each row holds prompt, response, continuation and response
tokens and right padding. The trainer is a transformers copy of the same weights.

* Its recomputed log-probabilities match the engine's ``infer_logprobs`` per response
  token, within float32 noise (a one-token misalignment is orders of magnitude off).
* One GRPO step raises the log-probability of every positive-advantage response token
  and lowers every negative one, and prompt and pad tokens get no gradient. That is
  exact when the step is taken on per-position logit offsets (each position's logits
  then move only its own token); the real optimizer step on the model's weights is
  checked on the tokens in aggregate, where tokens interact through shared weights.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollpipe import PipelineConfig, RolloutPipeline
from rollpipe.grpo import (
    group_advantages,
    grpo_step,
    policy_loss,
    shared_prefix_length,
    token_logprobs,
)


@pytest.fixture(scope="module")
def policy_and_batch(vllm_engine: Any, tiny_model_path: Any, tokenizer: Any) -> Any:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    vllm_engine.update_weights(policy)  # the engine runs exactly the trainer's weights
    config = PipelineConfig(
        envs="frozenlake",
        group_size=4,
        batch_size=8,
        seed=11,
        max_turns=2,
        sampling={"max_tokens": 12, "temperature": 1.0},
    )
    with RolloutPipeline(config, vllm_engine, tokenizer) as pipe:
        batch = pipe.get_batch()
    assert batch is not None
    return policy, batch


def _advantages(batch: Any) -> torch.Tensor:
    """GRPO advantages of made-up scores (the random tiny model's are all equal): in
    each group, alternate members score 1 and 0, so every row gets a non-zero advantage,
    of either sign."""
    groups = batch.batch["traj_group_id"]
    member = torch.tensor([int((groups[:i] == g).sum()) for i, g in enumerate(groups)])
    adv = group_advantages((member % 2).float(), groups)
    assert (adv > 0).any() and (adv < 0).any() and (adv != 0).all()
    return adv


def _next_token_masks(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks over positions ``t`` whose logits predict token ``t + 1``: a response token,
    or anything else (prompt, continuation, pad, and the last position)."""
    td = batch.batch
    response = torch.zeros_like(td["response_mask"])
    response[:, :-1] = td["response_mask"][:, 1:]
    return response, ~response


def test_batch_is_multi_turn_with_padding(policy_and_batch: Any) -> None:
    _, batch = policy_and_batch
    td = batch.batch
    assert (td["attention_mask"] == 0).any(), "no row is padded"
    # some row has a response, then prompt tokens (a continuation), then a response again
    diffs = td["response_mask"].int().diff(dim=-1)
    assert ((diffs == 1).sum(-1) >= 2).any(), "no row holds two turns"
    assert not (td["response_mask"] & ~td["attention_mask"].bool()).any()


def test_trainer_logprobs_match_infer_logprobs_per_token(policy_and_batch: Any) -> None:
    policy, batch = policy_and_batch
    td = batch.batch
    mask = td["response_mask"].bool()
    with torch.no_grad():
        ours = token_logprobs(policy, batch)
    gap = (ours - td["infer_logprobs"])[mask].abs()
    assert mask.sum() > 50
    assert gap.max() < 2e-3, f"max per-token gap {gap.max():.2e} (mean {gap.mean():.2e})"
    assert gap.mean() < 2e-4
    # The check has teeth: the same comparison one token off is far outside float noise.
    shifted = (ours[:, 1:] - td["infer_logprobs"][:, :-1])[mask[:, :-1] & mask[:, 1:]].abs()
    assert shifted.mean() > 100 * max(gap.mean().item(), 1e-6)


def test_shared_prefix_gives_the_same_logprobs_and_gradients(policy_and_batch: Any) -> None:
    """``share_prefix=True`` (what grpo_step uses) runs the common prefix once: the same
    response log-probabilities and the same gradient as the plain forward pass."""
    policy, batch = policy_and_batch
    mask = batch.batch["response_mask"].bool()
    assert shared_prefix_length(batch) > 20  # the system prompt and task text

    def response_sum(share: bool) -> tuple[torch.Tensor, torch.Tensor]:
        policy.zero_grad(set_to_none=True)
        logprobs = token_logprobs(policy, batch, share_prefix=share)
        logprobs[mask].sum().backward()
        grad = policy.get_input_embeddings().weight.grad.clone()
        return logprobs.detach()[mask], grad

    plain, plain_grad = response_sum(False)
    shared, shared_grad = response_sum(True)
    policy.zero_grad(set_to_none=True)
    assert (plain - shared).abs().max() < 1e-4
    assert (plain_grad - shared_grad).abs().max() < 1e-4 * plain_grad.abs().max()


class _LogitOffsets(torch.nn.Module):
    """The policy plus a trainable offset per position and vocabulary entry: a step on
    the offsets moves each position's log-probabilities and nothing else."""

    def __init__(self, model: torch.nn.Module, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.model = model
        self.delta = torch.nn.Parameter(torch.zeros(shape))

    def forward(self, **inputs: Any) -> Any:
        return SimpleNamespace(logits=self.model(**inputs).logits + self.delta)


def test_one_step_moves_every_response_token_the_advantages_way(policy_and_batch: Any) -> None:
    policy, batch = policy_and_batch
    td = batch.batch
    adv = _advantages(batch)
    policy.requires_grad_(False)
    try:
        with torch.no_grad():
            logits = policy(
                input_ids=td["input_ids"],
                attention_mask=td["attention_mask"],
                position_ids=td["position_ids"],
            ).logits
        offsets = _LogitOffsets(policy, tuple(logits.shape))
        before = token_logprobs(offsets, batch)
        policy_loss(before, batch, adv).backward()
        grad = offsets.delta.grad
        assert grad is not None
        predicts_response, predicts_other = _next_token_masks(batch)
        per_position = grad.abs().sum(-1)
        # prompt, continuation and pad tokens (and the last position) get no gradient ...
        assert (per_position[predicts_other] == 0).all()
        # ... every response token does, pushing its own logit the advantage's way
        assert (per_position[predicts_response] > 0).all()
        next_ids = torch.nn.functional.pad(td["input_ids"][:, 1:], (0, 1))
        own = grad.gather(-1, next_ids[..., None]).squeeze(-1)
        sign = adv.sign()[:, None].expand_as(own)
        assert (torch.sign(-own[predicts_response]) == sign[predicts_response]).all()

        # One plain gradient step on the offsets, of length 1 at each position; its effect
        # is measured in float64 so that no change is lost to rounding.
        step = grad / grad.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        with torch.no_grad():
            old = torch.log_softmax(logits.double(), -1).gather(-1, next_ids[..., None])
            new = torch.log_softmax((logits - step).double(), -1).gather(-1, next_ids[..., None])
        change = (new - old).squeeze(-1)
        rows = adv[:, None].expand_as(change)
        assert (change[predicts_response & (rows > 0)] > 0).all()
        assert (change[predicts_response & (rows < 0)] < 0).all()
        assert (change[predicts_other] == 0).all()  # prompt and pad log-probs untouched
    finally:
        policy.requires_grad_(True)


def test_pad_tokens_get_no_gradient_through_the_model(policy_and_batch: Any) -> None:
    policy, batch = policy_and_batch
    td = batch.batch
    captured: list[torch.Tensor] = []

    def keep(module: Any, inputs: Any, output: torch.Tensor) -> None:
        output.retain_grad()
        captured.append(output)

    hook = policy.get_input_embeddings().register_forward_hook(keep)
    try:
        loss = policy_loss(token_logprobs(policy, batch), batch, _advantages(batch))
        policy.zero_grad(set_to_none=True)
        loss.backward()
    finally:
        hook.remove()
        policy.zero_grad(set_to_none=True)
    grad = captured[0].grad
    assert grad is not None
    pads = td["attention_mask"] == 0
    assert pads.any()
    assert (grad[pads] == 0).all()  # nothing reads a pad token
    assert grad[~pads].abs().sum() > 0


def test_grpo_step_on_the_weights_moves_tokens_the_advantages_way(
    policy_and_batch: Any, tiny_model_path: Any
) -> None:
    from transformers import AutoModelForCausalLM

    _, batch = policy_and_batch
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    td = batch.batch
    adv = _advantages(batch)
    response = td["response_mask"].bool()
    with torch.no_grad():
        before = token_logprobs(policy, batch)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.05)
    figures = grpo_step(policy, optimizer, batch, advantages=adv, max_grad_norm=None)
    assert figures["active_rows"] == 1.0
    assert figures["logprob_gap"] < 2e-4  # the engine generated with these very weights
    with torch.no_grad():
        change = token_logprobs(policy, batch) - before
    rows = adv[:, None].expand_as(change)
    up, down = change[response & (rows > 0)], change[response & (rows < 0)]
    assert up.mean() > 0 > down.mean()
    # tokens share weights, so not every one need move its own way; most do
    assert (up > 0).float().mean() > 0.75 and (down < 0).float().mean() > 0.75


@pytest.mark.parametrize("size", [1, 3, 8, None])
def test_mini_batches_take_one_optimizer_step_each(
    policy_and_batch: Any, tiny_model_path: Any, size: int | None
) -> None:
    """``mini_batch_size`` (verl's ``ppo_mini_batch_size``, in rows): one Adam step per
    slice of the active rows; the first slice still sees the engine's exact weights."""
    from transformers import AutoModelForCausalLM

    _, batch = policy_and_batch
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    figures = grpo_step(
        policy, optimizer, batch, advantages=_advantages(batch), mini_batch_size=size
    )
    expected = -(-len(batch) // (size or len(batch)))  # every row is active
    assert figures["updates"] == expected
    steps = {int(s["step"]) for s in optimizer.state.values()}
    assert steps == {expected}
    assert figures["logprob_gap"] < 2e-4
    assert figures["clip_frac"] >= 0 and figures["grad_norm"] > 0


def test_mini_batch_size_must_be_positive(policy_and_batch: Any) -> None:
    policy, batch = policy_and_batch
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="mini_batch_size must be >= 1 or None, not 0"):
        grpo_step(policy, optimizer, batch, mini_batch_size=0)
