"""GRPO pieces a trainer needs on top of rollpipe's rows.

Small on purpose: group-normalised advantages keyed by ``traj_group_id``, the
policy's log-probabilities of the rows' tokens, and the clipped policy-gradient loss
over ``response_mask`` tokens (ratios against the engine's ``infer_logprobs``).
"""

from __future__ import annotations

import torch

from rollpipe.corrections import Corrected, Correction
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


def shared_prefix_length(batch: DataProto) -> int:
    """How many leading tokens every row has in common, stopping before the position
    that predicts the first response token of any row (so every response token's
    log-probability comes from the rows' own forward pass)."""
    td = batch.batch
    if td is None or len(td["input_ids"]) < 2:
        return 0
    ids, response = td["input_ids"], td["response_mask"].bool()
    starts = response.float().argmax(-1)[response.any(-1)]
    first_response = int(starts.min()) if len(starts) else ids.shape[1]
    same = (ids == ids[:1]).all(0) & td["attention_mask"].bool().all(0)
    differs = (~same).nonzero()
    common = int(differs[0]) if len(differs) else ids.shape[1]
    return max(0, min(common, first_response - 1))


def token_logprobs(
    model: torch.nn.Module, batch: DataProto, *, share_prefix: bool = False
) -> torch.Tensor:
    """Log-probability the model gives each row token, aligned with ``input_ids`` (0 at t=0).

    ``share_prefix=True`` runs the tokens all rows share (a system prompt and task text,
    about half of a short FrozenLake row) once and every row on top of copies of their
    key/value cache: the same values (gradients flow through the copies), less compute;
    positions inside the shared prefix then read 0 (they are never response tokens).
    """
    td = batch.batch
    if td is None:
        raise ValueError("token_logprobs needs a DataProto with input_ids and attention_mask")
    ids, positions = td["input_ids"], td["position_ids"]
    prefix = shared_prefix_length(batch) if share_prefix else 0
    cache = None
    if prefix > 0:
        head = model(
            input_ids=ids[:1, :prefix], position_ids=positions[:1, :prefix], use_cache=True
        )
        cache = head.past_key_values
        cache.batch_repeat_interleave(len(ids))
    logits = model(
        input_ids=ids[:, prefix:],
        attention_mask=td["attention_mask"],
        position_ids=positions[:, prefix:],
        past_key_values=cache,
        use_cache=cache is not None,
    ).logits.float()
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, prefix + 1 :, None])
    return torch.nn.functional.pad(picked.squeeze(-1), (prefix + 1, 0))


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")


def policy_loss(
    logprobs: torch.Tensor,
    batch: DataProto,
    advantages: torch.Tensor,
    clip: float = 0.2,
    loss_agg_mode: str = "token-mean",
    *,
    old_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO-clipped policy gradient over response tokens, mean over tokens.

    Ratios are taken against the engine's ``infer_logprobs`` (the behaviour policy),
    so off-policy tokens from a previous version are corrected. ``loss_agg_mode`` (verl's
    name): ``"token-mean"`` averages over all response tokens of the batch, so a long
    row weighs more; ``"seq-mean-token-mean"`` averages each row's tokens, then the rows
    (GRPO's original form: every trajectory weighs the same).

    With an off-policy correction (``rollpipe.corrections``): ``old_logprobs`` replaces
    ``infer_logprobs`` as the ratio's anchor (verl's decoupled mode), ``weights``
    multiply each token's objective (importance weights) and ``mask`` replaces
    ``response_mask`` (rejected tokens leave the loss and its mean).
    """
    td = batch.batch
    if td is None:
        raise ValueError("policy_loss needs a DataProto with response_mask and infer_logprobs")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"policy_loss: loss_agg_mode must be one of {LOSS_AGG_MODES}")
    mask = (td["response_mask"] if mask is None else mask).float()
    anchor = td["infer_logprobs"].float() if old_logprobs is None else old_logprobs.detach()
    ratio = torch.exp(logprobs - anchor)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    if weights is not None:
        objective = objective * weights.detach()
    if loss_agg_mode == "seq-mean-token-mean":
        per_row = (objective * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return -per_row.mean()
    return -(objective * mask).sum() / mask.sum().clamp(min=1.0)


def _turn_spans(response: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of response tokens in one row."""
    edges = torch.diff(response.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8))
    starts = (edges == 1).nonzero().squeeze(-1).tolist()
    ends = [*(edges == -1).nonzero().squeeze(-1).tolist(), len(response)]
    return list(zip(starts, ends[: len(starts)], strict=True))


def turn_advantages(batch: DataProto, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """GiGPO's step-level advantage, per token ``[B, T]``, from the rows alone.

    Turns of one ``traj_group_id`` that saw the same observation (the exact tokens the
    env sent since the previous answer: the first turn's prompt, then each feedback
    message) form a step group; each turn's answer tokens get its trajectory's
    ``episode_scores`` normalised within that group, 0 for a group of one. With a
    terminal reward this is the return from that state (GiGPO with discount 1): a move
    into a hole is compared with the other moves made from the same state, not with
    the whole episode. Add it to :func:`group_advantages` (``[:, None]``), as GiGPO does.
    """
    td = batch.batch
    if td is None:
        raise ValueError("turn_advantages needs a DataProto with tensors")
    ids, response = td["input_ids"], td["response_mask"].bool()
    scores = td["episode_scores"].to(torch.float64)
    groups: dict[tuple[int, bytes], list[tuple[int, int, int]]] = {}
    for row in range(len(ids)):
        previous = 0
        for start, end in _turn_spans(response[row]):
            key = (int(td["traj_group_id"][row]), ids[row, previous:start].numpy().tobytes())
            groups.setdefault(key, []).append((row, start, end))
            previous = end
    out = torch.zeros(ids.shape, dtype=torch.float64)
    for members in groups.values():
        if len(members) < 2:
            continue
        values = torch.stack([scores[row] for row, _, _ in members])
        centred = values - values.mean()
        normed = centred / (values.std() + eps) if scale else centred
        for (row, start, end), value in zip(members, normed, strict=True):
            out[row, start:end] = value
    return out.float()


TRAIN_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "infer_logprobs")
"""The row fields :func:`token_logprobs` and :func:`policy_loss` read."""


def active_rows(
    batch: DataProto, advantages: torch.Tensor, keys: tuple[str, ...] = TRAIN_KEYS
) -> tuple[DataProto, torch.Tensor]:
    """The rows with a non-zero advantage (the only ones with a gradient), their ``keys``
    (:data:`TRAIN_KEYS`) cut to their own longest row (right padding), and their advantages."""
    td = batch.batch
    if td is None:
        raise ValueError("active_rows needs a DataProto with tensors")
    nonzero = advantages != 0
    keep = (nonzero.any(-1) if advantages.dim() == 2 else nonzero).nonzero().squeeze(-1)
    mask = td["attention_mask"][keep]
    width = int(mask.sum(-1).max()) if len(keep) else 0
    tensors = {k: td[k][keep, :width] for k in keys}
    kept = advantages[keep, :width] if advantages.dim() == 2 else advantages[keep]
    return DataProto.from_dict(tensors=tensors), kept


def grpo_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: DataProto,
    *,
    clip: float = 0.2,
    max_grad_norm: float | None = 1.0,
    scale: bool = True,
    advantages: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    mini_batch_size: int | None = None,
    correction: Correction | None = None,
    policy_version: int | None = None,
) -> dict[str, float]:
    """One GRPO update on ``batch``: advantages of ``episode_scores`` within
    ``traj_group_id`` groups (or the given ``advantages``), the clipped loss on the
    response tokens of the rows with a non-zero advantage, one optimizer step per
    ``mini_batch_size`` of those rows (verl's ``ppo_mini_batch_size``, in rows, taken in
    order; None: one step on all of them). Ratios after the first step are against the
    engine's ``infer_logprobs``, so the clip bounds how far the later steps move.

    Rows of zero advantage (a group whose members all scored the same) have no
    gradient, so they are left out of the forward pass; the loss is the token mean over
    the rows that remain (``loss_agg_mode``, see :func:`policy_loss`; with none, no step
    is taken). Returns the step's figures, means over its optimizer steps:
    ``loss``, ``grad_norm`` (before clipping), ``active_rows`` (fraction of rows with a
    non-zero advantage), ``clip_frac`` (fraction of their response tokens whose ratio left
    ``[1 - clip, 1 + clip]``), ``logprob_gap`` (mean ``|trainer - infer_logprobs|`` on
    the first mini-batch's tokens before its step: near 0 when the engine ran the
    trainer's weights) and ``updates`` (optimizer steps taken).

    ``correction`` (a :class:`rollpipe.corrections.Correction`) corrects for the gap
    between trainer and engine (verl's decoupled mode): one forward pass without
    gradient gives the policy's log-probabilities before the update, the ratios are taken
    against those, each token's objective is multiplied by the correction's weights and
    its masks remove tokens; the figures then include its metrics (``rollout_corr/...``,
    ``staleness/...``, over the active rows). ``policy_version`` is the trainer's current
    version, for the correction's age weights and masks (None: the newest in the batch).
    """
    td = batch.batch
    if td is None:
        raise ValueError("grpo_step needs a DataProto with tensors")
    if mini_batch_size is not None and mini_batch_size < 1:
        raise ValueError(f"grpo_step: mini_batch_size must be >= 1 or None, not {mini_batch_size}")
    if advantages is None:
        advantages = group_advantages(td["episode_scores"], td["traj_group_id"], scale=scale)
    keys: tuple[str, ...] = TRAIN_KEYS
    if correction is not None and correction.uses_versions:
        if "policy_versions" not in td:
            raise ValueError(
                "grpo_step: the correction's max_staleness / staleness_decay need the rows' "
                "policy_versions column; the batch has none"
            )
        keys = (*TRAIN_KEYS, "policy_versions")
    rows, adv = active_rows(batch, advantages, keys)
    figures = {"loss": 0.0, "grad_norm": 0.0, "active_rows": len(rows) / max(1, len(batch))}
    figures.update(clip_frac=0.0, logprob_gap=0.0, updates=0.0)
    size = mini_batch_size or max(1, len(rows))
    starts = range(0, len(rows), size)
    fixed: Corrected | None = None
    old: torch.Tensor | None = None
    if correction is not None and len(rows):
        policy.train()
        with torch.no_grad():
            old = torch.cat(
                [token_logprobs(policy, rows[i : i + size], share_prefix=True) for i in starts]
            )
        fixed = correction.apply(old, rows, current_version=policy_version)
        figures.update(fixed.metrics)
    steps = []
    for i in starts:
        part = slice(i, i + size)
        extra = {}
        if fixed is not None and old is not None:
            extra = {
                "old_logprobs": old[part],
                "weights": fixed.weights[part],
                "mask": fixed.mask[part],
            }
        steps.append(
            _update(
                policy, optimizer, rows[part], adv[part], clip, max_grad_norm, loss_agg_mode, extra
            )
        )
    if steps:
        for key in ("loss", "grad_norm", "clip_frac"):
            figures[key] = sum(s[key] for s in steps) / len(steps)
        figures.update(logprob_gap=steps[0]["logprob_gap"], updates=float(len(steps)))
    return figures


def _update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: DataProto,
    adv: torch.Tensor,
    clip: float,
    max_grad_norm: float | None,
    loss_agg_mode: str,
    correction: dict[str, torch.Tensor],
) -> dict[str, float]:
    """One optimizer step on ``rows`` (``correction``: :func:`policy_loss`'s keywords);
    the figures :func:`grpo_step` reports."""
    policy.train()
    logprobs = token_logprobs(policy, rows, share_prefix=True)
    loss = policy_loss(logprobs, rows, adv, clip=clip, loss_agg_mode=loss_agg_mode, **correction)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for p in policy.parameters() if p.grad is not None]
    limit = float("inf") if max_grad_norm is None else max_grad_norm  # inf: measure only
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    optimizer.step()
    with torch.no_grad():
        rtd = rows.batch
        assert rtd is not None
        response = rtd["response_mask"].bool()
        infer = rtd["infer_logprobs"].float()
        gap = (logprobs.detach() - infer)[response]
        anchor = correction.get("old_logprobs", infer)
        ratio = (logprobs.detach() - anchor)[response].exp()
        clipped = ((ratio < 1 - clip) | (ratio > 1 + clip)).float()
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(norm),
        "clip_frac": float(clipped.mean()) if clipped.numel() else 0.0,
        "logprob_gap": float(gap.abs().mean()) if gap.numel() else 0.0,
    }
