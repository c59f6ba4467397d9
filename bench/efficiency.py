"""Benchmark 1: how much of the raw engine's speed a FrozenLake / Sokoban pipeline keeps.

Workload: ``n`` episodes (all in flight at once: ``concurrency = n``), ``turns`` turns
each, every turn exactly ``k`` generated tokens (``SamplingParams(ignore_eos=True,
max_tokens=k)``; the turn ends with finish_reason "length", ``on_length="skip"`` keeps
the episode going to ``max_turns``).

* **pipeline** — ``RolloutPipeline.get_batch(-1)``: env resets and steps, prompt
  building, generation, grouping, batching, collation. Timed from the call to the
  returned ``DataProto``.
* **raw engine** — the same requests replayed on the engine alone: for each turn
  index, one ``generate_batch``-style call holding every episode's request of that turn
  (the exact prompt ids the pipeline sent, so prompt lengths and prefix-cache behaviour
  match; the same per-request seeds; the same ``k`` output tokens).

Both arms start with an empty vLLM prefix cache. Figure per env:
``efficiency_<env>`` = pipeline tokens/s / raw tokens/s (median of per-repeat ratios).
"""

from __future__ import annotations

from typing import Any

from bench.common import (
    BenchContext,
    Figures,
    capture_hook,
    generate_each,
    median,
    reset_prefix_cache,
    rounded,
    timed,
)
from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.records import Trajectory
from rollpipe.engines.records import SamplingParams
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

Request = tuple[list[int], SamplingParams]


def requests_by_turn(trajectories: list[Trajectory]) -> list[list[Request]]:
    """The engine requests behind ``trajectories``, grouped by turn index.

    Turn t's prompt is every earlier turn's prompt and response ids plus this turn's
    ``prompt_ids`` (conversation mode); its params carry the seed ``run_episode`` used
    and ``max_tokens`` = the tokens the engine actually produced.
    """
    by_turn: list[list[Request]] = []
    for traj in trajectories:
        context: list[int] = []
        for t, turn in enumerate(traj.turns):
            prompt = [*context, *turn.prompt_ids]
            params = SamplingParams(
                max_tokens=len(turn.response_ids),
                ignore_eos=True,
                seed=derive_seed(traj.seed, traj.episode_id, t),
            )
            if len(by_turn) <= t:
                by_turn.append([])
            by_turn[t].append((prompt, params))
            context = [*prompt, *turn.response_ids]
    return by_turn


def pipeline_arm(
    ctx: BenchContext, env: str, n: int, turns: int, k: int, seed: int
) -> tuple[float, int, list[Trajectory]]:
    """(seconds, generated tokens, trajectories) of one pipeline drain."""
    config = PipelineConfig(
        envs=env,
        group_size=4,
        batch_size=n,
        num_groups=n // 4,
        seed=seed,
        max_turns=turns,
        max_length=int(getattr(ctx.engine, "max_model_len", 2048)),
        concurrency=n,
        sampling=SamplingParams(max_tokens=k, ignore_eos=True),
    )
    trajs: list[Any] = []
    with RolloutPipeline(
        config, ctx.engine, ctx.tokenizer, hooks={"rollout": capture_hook(trajs)}
    ) as pipe:
        seconds, batch = timed(lambda: pipe.get_batch(-1))
    if batch is None or len(batch) != n:
        raise RuntimeError(f"efficiency: pipeline returned {batch!r}, expected {n} rows")
    tokens = int(batch.batch["response_mask"].sum())
    return seconds, tokens, trajs


def raw_arm(ctx: BenchContext, by_turn: list[list[Request]]) -> tuple[float, int]:
    """(seconds, generated tokens) of the same requests, one batched call per turn."""
    tokens = 0

    def replay() -> None:
        nonlocal tokens
        for reqs in by_turn:
            gens = generate_each(ctx.engine, [p for p, _ in reqs], [sp for _, sp in reqs])
            tokens += sum(g.num_tokens for g in gens)

    seconds, _ = timed(replay)
    return seconds, tokens


def run(
    ctx: BenchContext,
    envs: tuple[str, ...] = ("frozenlake", "sokoban"),
    sizes: tuple[int, int, int] | None = None,
) -> Figures:
    """``sizes`` = (episodes, turns, tokens per turn); default by ``ctx.quick``."""
    n, turns, k = sizes or ctx.size(smoke=(8, 2, 8), quick=(32, 3, 32), full=(64, 4, 64))
    if n % 4:
        raise ValueError(f"efficiency: episodes must be a multiple of the group size 4, got {n}")
    out: Figures = {"efficiency_episodes": n, "efficiency_turns": turns, "efficiency_k": k}
    for env in envs:
        ratios, pipe_tps, raw_tps = [], [], []
        for rep in range(ctx.repeats_for(5)):
            reset_prefix_cache(ctx.engine)
            p_s, p_tok, trajs = pipeline_arm(ctx, env, n, turns, k, seed=rep)
            by_turn = requests_by_turn(trajs)
            reset_prefix_cache(ctx.engine)
            r_s, r_tok = raw_arm(ctx, by_turn)
            if r_tok != p_tok:
                raise RuntimeError(
                    f"efficiency[{env}]: raw replay generated {r_tok} tokens, the pipeline "
                    f"{p_tok}; the workloads must match"
                )
            pipe_tps.append(p_tok / p_s)
            raw_tps.append(r_tok / r_s)
            ratios.append(pipe_tps[-1] / raw_tps[-1])
            ctx.log(
                f"  efficiency {env} rep {rep}: pipeline {p_tok} tok in {p_s:.2f}s, "
                f"raw {r_tok} tok in {r_s:.2f}s, ratio {ratios[-1]:.2f}"
            )
        out[f"efficiency_{env}"] = rounded(median(ratios))
        out[f"efficiency_{env}_pipeline_tokens_per_s"] = rounded(median(pipe_tps))
        out[f"efficiency_{env}_raw_tokens_per_s"] = rounded(median(raw_tps))
    return out
