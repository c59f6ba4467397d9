"""Benchmark 13: the staleness policy, ``drop`` against ``wait`` at the same bound.

A GRPO-shaped loop over uneven episodes, where first finishers fill the batches
(``in_order=False``) and a group can outlive several trainer steps:
``get_batch(data, batch_size)``, ``TRAIN_S`` seconds standing for the trainer's step
(generation runs ahead meanwhile), ``suspend()`` (abort), ``update_weights`` (the same
weights, a new version). The workload is ``bench.long_tail``'s: heavy-tailed episodes
(1..8 turns) and response lengths (``LengthBySeed``). Both policies run with
``async_generation_ratio=1`` on the shared engine, side by side in one run. Per policy:

* ``staleness_{policy}_trajectories_per_s`` — trajectories per second over the loop,
  weight syncs included;
* ``staleness_{policy}_wasted_share`` — share of the generated tokens that belonged to
  groups dropped (``dropped/wasted_tokens``: stale groups, errors) — what ``drop`` pays;
* ``staleness_{policy}_unused_share`` — share of all generated tokens in no batch
  (the above, aborted partial turns, and the run-ahead in flight when the loop ends),
  counted at the engine;
* ``staleness_{policy}_stale_groups_per_batch`` — groups dropped as stale per batch;
* ``staleness_{policy}_tokens_{k}_behind`` — share of the batches' response tokens
  generated ``k`` versions before the version current when the batch was returned
  (k = 0, 1, 2+), and ``..._group_age_max``: the oldest group's age in any batch.

``staleness_wait_vs_drop_trajectories`` is wait's trajectories/s ÷ drop's (median of the
per-repeat ratios).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

from bench.common import BenchContext, Figures, median, reset_prefix_cache, rounded
from bench.long_tail import ENV, LengthBySeed
from bench.on_policy import CountingEngine
from rollpipe.data.proto import DataProto
from rollpipe.engines.records import SamplingParams
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

TRAIN_S = 0.5  # the stand-in trainer step, per batch
RATIO = 1  # the staleness bound both policies keep
POLICIES = ("drop", "wait")


def _loop(
    ctx: BenchContext, weights: Any, policy: str, steps: int, batch_size: int, scale: float
) -> dict[str, float]:
    reset_prefix_cache(ctx.engine)
    engine = CountingEngine(LengthBySeed(ctx.engine, scale))
    config = PipelineConfig(
        envs=ENV,
        group_size=4,
        batch_size=batch_size,
        max_turns=8,
        max_length=1024,
        on_length="step",
        concurrency=2 * batch_size,
        in_order=False,  # first finishers fill the batch
        seed=13,
        async_generation_ratio=RATIO,
        max_off_policy_strategy=policy,
        sampling=SamplingParams(max_tokens=128),
    )
    used = trajectories = wasted = stale = oldest = 0
    ages: Counter[int] = Counter()
    with RolloutPipeline(config, engine, ctx.tokenizer) as pipe:  # type: ignore[arg-type]
        start = time.perf_counter()
        for step in range(steps):
            batch = pipe.get_batch(DataProto(meta_info={"global_step": step}), batch_size)
            assert batch is not None
            mask = batch.batch["response_mask"].bool()
            behind = pipe.version - batch.batch["policy_versions"][mask]
            ages.update(torch.clamp(behind, max=2).tolist())
            oldest = max(oldest, int(behind.max()))
            used += int(mask.sum())
            trajectories += len(batch)
            metrics = batch.meta_info["metrics"]
            wasted += int(metrics.get("dropped/wasted_tokens", 0))
            stale += int(metrics.get("dropped/stale", 0))
            time.sleep(TRAIN_S)  # the trainer's step; generation may run ahead meanwhile
            pipe.suspend()
            pipe.update_weights(weights)
        elapsed = time.perf_counter() - start
    total = sum(ages.values()) or 1
    generated = engine.generated or 1
    return {
        "trajectories_per_s": trajectories / elapsed,
        "wasted_share": wasted / generated,
        "unused_share": (engine.generated - used) / generated,
        "stale_groups_per_batch": stale / steps,
        "tokens_0_behind": ages[0] / total,
        "tokens_1_behind": ages[1] / total,
        "tokens_2plus_behind": ages[2] / total,
        "group_age_max": float(oldest),
    }


def run(ctx: BenchContext) -> Figures:
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(str(ctx.model_path)).state_dict()
    steps, batch_size = ctx.size(smoke=(2, 8), quick=(8, 16), full=(16, 32))
    scale = 0.5 if ctx.quick or ctx.smoke else 1.0
    figures: Figures = {
        "staleness_steps": steps,
        "staleness_batch_size": batch_size,
        "staleness_bound": RATIO,
    }
    reps: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for _ in range(ctx.repeats_for()):
        for policy in POLICIES:  # alternated, so both see the same machine load
            reps[policy].append(_loop(ctx, weights, policy, steps, batch_size, scale))
    for policy in POLICIES:
        for key in reps[policy][0]:
            value = median([r[key] for r in reps[policy]])
            figures[f"staleness_{policy}_{key}"] = rounded(value)
        ctx.log(
            f"  {policy}: "
            + ", ".join(f"{k} {figures[f'staleness_{policy}_{k}']}" for k in reps[policy][0])
        )
    ratios = [
        w["trajectories_per_s"] / d["trajectories_per_s"]
        for w, d in zip(reps["wait"], reps["drop"], strict=True)
    ]
    figures["staleness_wait_vs_drop_trajectories"] = rounded(median(ratios))
    ctx.log(f"  wait ÷ drop trajectories/s: {figures['staleness_wait_vs_drop_trajectories']}")
    return figures
