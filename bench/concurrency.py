"""Benchmark 5: throughput and peak RSS at 1, 8, 64 and 256 concurrent episodes.

Workload per level ``c``: a FrozenLake pipeline (group size 1) with ``concurrency = c``
draining ``max(c, 4)`` episodes of ``turns`` turns of exactly ``k`` tokens
(``ignore_eos``), so the work per episode is the same at every level. The engine runs
up to 256 sequences at once (``bench.common.ENGINE_KWARGS``).

Figures per level (medians over repeats): ``concurrency_<c>_tokens_per_s`` (generated
tokens / wall time), ``concurrency_<c>_trajectories_per_s``,
``concurrency_<c>_peak_rss_mb`` (the process's resident set, sampled every 10 ms during
the run) and ``concurrency_<c>_rss_growth_mb`` (peak minus the RSS when the run
started). The process holds the in-process engine too: torch, vLLM, the model and a
1 GiB KV pool (~1.7 GB before any request). vLLM's own RSS creeps up over its first
runs on new prompts (a raw ``generate_batch`` loop shows the same drift, which then
levels off), so later levels carry some of that drift; Python object counts stay flat
across pipeline runs (no leak in rollpipe).
"""

from __future__ import annotations

from bench.common import (
    BenchContext,
    Figures,
    PeakRSS,
    median,
    reset_prefix_cache,
    rounded,
    timed,
)
from rollpipe.engines.records import SamplingParams
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

LEVELS = (1, 8, 64, 256)


def one_level(
    ctx: BenchContext, c: int, turns: int, k: int, seed: int
) -> tuple[float, int, int, PeakRSS]:
    """(seconds, trajectories, tokens, RSS sampler) of one drain at concurrency ``c``."""
    n = max(c, 4)
    config = PipelineConfig(
        envs="frozenlake",
        group_size=1,
        batch_size=n,
        num_groups=n,
        seed=seed,
        max_turns=turns,
        max_length=int(getattr(ctx.engine, "max_model_len", 2048)),
        concurrency=c,
        sampling=SamplingParams(max_tokens=k, ignore_eos=True),
    )
    reset_prefix_cache(ctx.engine)
    with PeakRSS() as rss, RolloutPipeline(config, ctx.engine, ctx.tokenizer) as pipe:
        seconds, batch = timed(lambda: pipe.get_batch(-1))
    if batch is None or len(batch) != n:
        raise RuntimeError(f"concurrency {c}: pipeline returned {batch!r}, expected {n} rows")
    return seconds, n, int(batch.batch["response_mask"].sum()), rss


def run(ctx: BenchContext, levels: tuple[int, ...] = LEVELS) -> Figures:
    turns, k = ctx.size(smoke=(1, 8), quick=(2, 16), full=(3, 32))
    levels = ctx.size(smoke=levels[:2], quick=levels, full=levels)
    out: Figures = {"concurrency_turns": turns, "concurrency_k": k}
    for c in levels:
        tps, trps, peaks, growth = [], [], [], []
        for rep in range(ctx.repeats_for()):
            seconds, n, tokens, rss = one_level(ctx, c, turns, k, seed=rep)
            tps.append(tokens / seconds)
            trps.append(n / seconds)
            peaks.append(rss.peak_mb)
            growth.append(rss.peak_mb - rss.start_mb)
            ctx.log(
                f"  concurrency {c} rep {rep}: {n} episodes, {tokens} tok in {seconds:.2f}s, "
                f"peak RSS {rss.peak_mb:.0f} MB (+{growth[-1]:.0f})"
            )
        out[f"concurrency_{c}_tokens_per_s"] = rounded(median(tps))
        out[f"concurrency_{c}_trajectories_per_s"] = rounded(median(trps))
        out[f"concurrency_{c}_peak_rss_mb"] = rounded(median(peaks))
        out[f"concurrency_{c}_rss_growth_mb"] = rounded(median(growth))
    return out
