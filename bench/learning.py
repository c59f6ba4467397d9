"""Benchmark 10: a policy that plays, GRPO that improves it, rows that train correctly.

On the warm start that ships with rollpipe (its own vLLM engine, float32):

* ``warm_start_success`` / ``warm_start_score`` — held-out FrozenLake success and mean
  score, greedy, through the pipeline (:func:`rollpipe.training.evaluate.evaluate`), next
  to ``random_valid_success`` (a uniformly random valid action on the same seeds) and
  ``warm_start_build_s`` (the build time recorded when the shipped copy was built);
* ``logprob_gap_mean`` / ``logprob_gap_max`` — |``infer_logprobs`` − the trainer's
  recompute| on the response tokens of a real batch (vLLM float32 vs transformers
  float32, same weights); ``logprob_gap_bf16_*`` the same with both in bfloat16;
* ``trainer_shared_prefix_speedup`` — a GRPO forward and backward over a real batch,
  plain ÷ with the shared prefix run once (``token_logprobs(share_prefix=True)``);
* ``grpo_success_gain`` — held-out success after ``grpo_steps`` GRPO steps minus before
  (:func:`rollpipe.training.grpo_loop.train_grpo`), the median over ``grpo_seeds`` training
  seeds, with ``grpo_minutes`` (the median run's wall time, evaluations included);
* ``grpo_gain/<kind>`` — the same for the other episode kinds, each from its own shipped
  warm start with its documented settings (:data:`KINDS`, docs/learning.md): ``lookup``
  (a tool the answer needs), ``lookup-agent`` (the same task as an ``openai``-client
  agent, through the front door) and ``sums`` (a prompt dataset through ``PromptTask``,
  its held-out problems); ``grpo_without_tool/lookup`` is the trained policy's held-out
  success with the tool's answers taken away.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
from rich.console import Console

from bench.common import BenchContext, Figures, median, rounded
from rollpipe.config import PipelineConfig
from rollpipe.engines.vllm import VLLMEngine
from rollpipe.grpo import token_logprobs
from rollpipe.pipeline import RolloutPipeline
from rollpipe.training.evaluate import evaluate, random_valid_success
from rollpipe.training.grpo_loop import train_grpo
from rollpipe.training.warm_start import warm_start_model_path
from rollpipe.training.warm_start_files import RECIPE_FILE

GRPO = {"batch_size": 128, "group_size": 8, "lr": 2e-4, "warmup": 5, "turn_weight": 1.0}
KINDS: dict[str, dict[str, Any]] = {
    "lookup": {"batch_size": 64, "group_size": 8, "lr": 5e-4},
    "lookup-agent": {"batch_size": 64, "group_size": 8, "lr": 5e-4},
    "sums": {"batch_size": 128, "group_size": 8, "lr": 2e-4},
}
"""Each episode kind's GRPO settings, as docs/learning.md runs them (steps: ``_kinds``)."""


def _batch(engine: Any, tokenizer: Any, seed: int) -> Any:
    config = PipelineConfig(
        envs="frozenlake",
        group_size=8,
        batch_size=64,
        seed=seed,
        max_turns=6,
        sampling={"max_tokens": 24, "temperature": 1.0},
    )
    with RolloutPipeline(config, engine, tokenizer) as pipe:
        return pipe.get_batch()


def _gap(policy: Any, batch: Any) -> tuple[float, float]:
    td = batch.batch
    mask = td["response_mask"].bool()
    with torch.no_grad():
        gap = (token_logprobs(policy, batch).float() - td["infer_logprobs"].float())[mask].abs()
    return float(gap.mean()), float(gap.max())


def _forward_backward_s(policy: Any, batch: Any, share: bool) -> float:
    mask = batch.batch["response_mask"].bool()
    start = time.perf_counter()
    token_logprobs(policy, batch, share_prefix=share)[mask].sum().backward()
    policy.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _row_figures(path: Any, tokenizer: Any, repeats: int) -> Figures:
    from transformers import AutoModelForCausalLM

    figures: Figures = {}
    for dtype, tag in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
        name = "float32" if dtype is torch.float32 else "bfloat16"
        try:
            engine = VLLMEngine(path, dtype=name, seed=0)
        except Exception as exc:  # bf16 needs CPU support; report why it is missing
            figures[f"logprob_gap{tag}_mean"] = f"n/a ({type(exc).__name__})"
            continue
        with engine:
            batch = _batch(engine, tokenizer, seed=7)
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        mean, worst = _gap(policy, batch)
        figures[f"logprob_gap{tag}_mean"] = float(f"{mean:.3g}")
        figures[f"logprob_gap{tag}_max"] = float(f"{worst:.3g}")
        if dtype is torch.float32:
            plain = median([_forward_backward_s(policy, batch, False) for _ in range(repeats)])
            shared = median([_forward_backward_s(policy, batch, True) for _ in range(repeats)])
            figures["trainer_shared_prefix_speedup"] = rounded(plain / shared, 2)
    return figures


def run(ctx: BenchContext) -> Figures:
    from transformers import AutoTokenizer

    path = warm_start_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    episodes = ctx.size(smoke=16, quick=100, full=200)
    figures: Figures = {}
    with VLLMEngine(path, seed=0) as engine:
        result = evaluate(engine, tokenizer, episodes=episodes)
    figures["warm_start_success"] = rounded(result.success)
    figures["warm_start_score"] = rounded(result.score)
    figures["random_valid_success"] = rounded(random_valid_success(episodes=episodes))
    recorded = json.loads((path / RECIPE_FILE).read_text())
    figures["warm_start_build_s"] = recorded.get("train_seconds")
    figures.update(_row_figures(path, tokenizer, ctx.repeats_for(3)))

    steps = ctx.size(smoke=1, quick=10, full=50)
    seeds = range(ctx.size(smoke=1, quick=1, full=3))
    runs = []
    for seed in seeds:
        ctx.log(f"  GRPO seed {seed}: {steps} steps")
        out = train_grpo(
            steps=steps,
            seed=seed,
            eval_every=0,
            eval_episodes=episodes,
            console=Console(quiet=True),
            **GRPO,
        )
        first, last = out["evals"][0], out["evals"][-1]
        runs.append((last["success"] - first["success"], out["minutes"]))
    runs.sort()
    gain, minutes = runs[len(runs) // 2]
    figures["grpo_success_gain"] = rounded(gain)
    figures["grpo_success_gains"] = [rounded(g) for g, _ in runs]
    figures["grpo_steps"] = steps
    figures["grpo_minutes"] = rounded(minutes, 1)
    figures["grpo_eval_episodes"] = episodes
    figures.update(_kinds(ctx, episodes))
    return figures


def _kinds(ctx: BenchContext, episodes: int) -> Figures:
    """Held-out greedy success gained by GRPO on each kind of :data:`KINDS`: the median
    over the training seeds, its minutes, and every seed's gain."""
    figures: Figures = {}
    steps = ctx.size(smoke=1, quick=10, full=40)
    for kind, settings in KINDS.items():
        runs = []
        for seed in range(ctx.size(smoke=1, quick=1, full=3)):
            ctx.log(f"  GRPO on {kind}, seed {seed}: {steps} steps")
            out = train_grpo(
                steps=steps,
                seed=seed,
                env=kind,
                eval_every=0,
                eval_episodes=episodes,
                console=Console(quiet=True),
                **settings,
            )
            first, last = out["evals"][0], out["evals"][-1]
            runs.append((last["success"] - first["success"], out["minutes"], last))
        runs.sort(key=lambda run: run[0])
        gain, minutes, last = runs[len(runs) // 2]
        figures[f"grpo_gain/{kind}"] = rounded(gain)
        figures[f"grpo_gains/{kind}"] = [rounded(g) for g, _, _ in runs]
        figures[f"grpo_minutes/{kind}"] = rounded(minutes, 1)
        if "success_without_tool" in last:
            figures[f"grpo_without_tool/{kind}"] = rounded(last["success_without_tool"])
    figures["grpo_kind_steps"] = steps
    return figures
