"""Supervised fine-tuning on expert episodes: the loss, batching with a shared prefix.

Every FrozenLake conversation starts with the same ~170 tokens (system prompt, task,
legend, answer format), about half of each sequence. A batch runs that common prefix
once (batch size 1) and the rest of every row on top of its expanded key/value cache,
so the prefix costs one row's forward and backward instead of ``B``; gradients flow
through the shared cache exactly as through ``B`` copies.

The loss is the response tokens only: ordinary cross-entropy on the answer's scaffold
tokens (``<answer``, ``</``, ``answer``, ``>``, end of turn) and, on the action token,
``-log P(any optimal action)`` (the set comes with the episode, see
:mod:`rollpipe.training.expert`). The two are averaged separately and added.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rollpipe.training.expert import OBSERVATION, RESPONSE, ExpertEpisode

__all__ = ["batch_loss", "length_batches", "train_sft"]


def _common_prefix(rows: Sequence[torch.Tensor]) -> int:
    first = rows[0]
    n = min(len(r) for r in rows)
    for row in rows[1:]:
        same = (row[:n] == first[:n]).to(torch.int8)
        n = int(same.argmin()) if not bool(same.all()) else n
    return n


def batch_loss(
    model: torch.nn.Module,
    episodes: Sequence[ExpertEpisode],
    pad_id: int,
    observation_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of a batch of expert episodes and its parts (``format``, ``action`` and
    ``observation`` nats, ``action_acc``: how often the most likely action token is an
    optimal one). ``observation_weight`` weighs the auxiliary loss on env feedback."""
    rows = [torch.from_numpy(e.ids) for e in episodes]
    b, length = len(rows), max(len(r) for r in rows)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.long)
    targets = torch.full((b, length), -1, dtype=torch.long)
    kinds = torch.zeros((b, length), dtype=torch.int8)
    for i, (row, e) in enumerate(zip(rows, episodes, strict=True)):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
        targets[i, : len(row)] = torch.from_numpy(e.targets)
        kinds[i, : len(row)] = torch.from_numpy(e.kinds)
    first_loss = min(
        min([p for p, _ in e.actions] + [int(i) for i in (e.targets >= 0).nonzero()[0][:1]])
        for e in episodes
    )
    prefix = min(_common_prefix(rows), first_loss) if b > 1 else 0
    cache = None
    if prefix > 0:
        out = model(input_ids=ids[:1, :prefix], use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(b)
    out = model(
        input_ids=ids[:, prefix:],
        attention_mask=mask,
        position_ids=torch.arange(prefix, length)[None].expand(b, -1),
        past_key_values=cache,
        use_cache=cache is not None,
    )
    logp = torch.log_softmax(out.logits.float(), dim=-1)  # [B, length - prefix, V]
    tgt, kind = targets[:, prefix:], kinds[:, prefix:]
    picked = logp.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1)
    fmt_mask, obs_mask = kind == RESPONSE, kind == OBSERVATION
    fmt = -(picked * fmt_mask).sum() / fmt_mask.sum().clamp(min=1)
    obs = -(picked * obs_mask).sum() / obs_mask.sum().clamp(min=1)
    rows_idx, pos_idx, opt_lists = [], [], []
    for i, e in enumerate(episodes):
        for pos, optimal in e.actions:
            rows_idx.append(i)
            pos_idx.append(pos - prefix)
            opt_lists.append(optimal)
    if rows_idx:
        at = logp[torch.tensor(rows_idx), torch.tensor(pos_idx)]  # [N, V]
        width = max(len(o) for o in opt_lists)
        opt = torch.tensor([list(o) + [o[0]] * (width - len(o)) for o in opt_lists])
        valid = torch.tensor([[j < len(o) for j in range(width)] for o in opt_lists])
        chosen = at.gather(-1, opt).masked_fill(~valid, -math.inf)
        action = -torch.logsumexp(chosen, dim=-1).mean()
        best = at.argmax(-1)
        acc = (opt == best[:, None]).logical_and(valid).any(-1).float().mean().item()
    else:
        action, acc = fmt.new_zeros(()), float("nan")
    loss = fmt + action + observation_weight * obs
    parts = {"format": fmt.item(), "action": action.item(), "observation": obs.item()}
    return loss, {**parts, "action_acc": acc}


def length_batches(
    episodes: Iterator[ExpertEpisode], batch_size: int, pool: int, seed: int
) -> Iterator[list[ExpertEpisode]]:
    """Batches of episodes of similar length: ``pool`` batches' worth are read, sorted by
    length, cut into batches, and yielded in a seeded random order."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        chunk = [e for _, e in zip(range(batch_size * pool), episodes, strict=False)]
        if not chunk:
            return
        chunk.sort(key=lambda e: len(e.ids))
        batches = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        for j in torch.randperm(len(batches), generator=gen).tolist():
            yield batches[j]


def train_sft(
    model: torch.nn.Module,
    batches: Iterator[list[ExpertEpisode]],
    pad_id: int,
    *,
    steps: int,
    lr: float,
    warmup: int,
    weight_decay: float = 0.0,
    min_lr_ratio: float = 0.05,
    clip: float = 1.0,
    observation_weight: float = 0.0,
    on_step: Callable[[int, dict[str, float]], Any] | None = None,
) -> list[dict[str, float]]:
    """AdamW with linear warm-up then cosine decay; returns each step's loss parts."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
    )

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    history = []
    for step, batch in zip(range(steps), batches, strict=False):
        loss, parts = batch_loss(model, batch, pad_id, observation_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
        parts["loss"] = loss.item()
        parts["tokens"] = float(sum(len(e.ids) for e in batch))
        history.append(parts)
        if on_step is not None:
            on_step(step, parts)
    model.eval()
    return history
