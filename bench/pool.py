"""Benchmark 8: many engines behind one (``EnginePool``), each arm side by side.

* **Routing** — ``pool_{sticky,sticky_tokens,random}_tokens_per_s`` and
  ``_prefix_hit_rate`` (prompt tokens served by vLLM's prefix cache ÷ prompt tokens): a
  multi-turn FrozenLake pipeline on two in-process engines, sticky routing with new
  episodes by fewest in-flight requests (the default) or by fewest queued tokens,
  against random routing; ``pool_sticky_vs_random`` and ``pool_requests_vs_tokens`` are
  tokens/s ratios of the default against the other two.
* **Shrink / expand** — ``pool_shrink_ms`` (mid-batch, 1 of 2 ranks), ``pool_rerouted``
  (requests it cut and re-sent), ``pool_shrink_stall_ms`` (the longest request that
  spanned the shrink, end to end: what a live episode waits at worst) against
  ``pool_request_median_ms``; ``pool_expand_load_ms`` (rebuild + load the current
  weights) and ``pool_expand_skip_load_ms`` (rebuild, version checked).
* **1 vs 2 engines** — ``pool_{inproc,multiprocess}_{1,2}_tokens_per_s`` and their
  ``_ratio``: the same pipeline on one engine and on a pool of two. In-process CPU
  engines run their forward passes one at a time (``CPU_FORWARD_LOCK``), so two of them
  cannot beat one; ``multiprocess=True`` engines compute in their own processes. Why two
  of those gain little on a small host: ``pool_multiprocess_{1,2}_{driver,engine}_cores``
  (CPU time ÷ wall time of this process and of the engine processes) and
  ``pool_engine_16_vs_32`` (one engine's tokens/s at 16 requests at once ÷ at 32: below
  1 when a decode step costs nearly the same for half the batch).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import psutil

from bench.common import ENGINE_KWARGS, BenchContext, Figures, median, rounded
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.engines.vllm import VLLMEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

KV_GIB = 0.25


class RequestLog:
    """The engine under test, recording each request: wall times, prompt and cached tokens."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.requests: list[tuple[float, float, int, int, int]] = []

    async def generate(self, prompt_ids: Any, params: SamplingParams) -> Generation:
        start = time.perf_counter()
        gen = await self._engine.generate(prompt_ids, params)
        cached = gen.cached_tokens or 0
        self.requests.append((start, time.perf_counter(), len(prompt_ids), cached, gen.num_tokens))
        return gen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _config(quick: bool, seed: int) -> PipelineConfig:
    return PipelineConfig(
        envs="frozenlake",
        group_size=4,
        batch_size=16 if quick else 32,
        max_turns=5,
        concurrency=16 if quick else 32,
        seed=seed,
        sampling=SamplingParams(max_tokens=24),
    )


def _tokens_per_s(ctx: BenchContext, engine: Any, batches: int, seed: int) -> dict[str, float]:
    log = RequestLog(engine)
    with RolloutPipeline(_config(ctx.quick, seed), log, ctx.tokenizer) as pipe:  # type: ignore[arg-type]
        pipe.get_batch()  # warm: first requests, prefix cache
        log.requests.clear()
        start = time.perf_counter()
        for _ in range(batches):
            pipe.get_batch()
        elapsed = time.perf_counter() - start
    prompt = sum(r[2] for r in log.requests)
    return {
        "tokens_per_s": sum(r[4] for r in log.requests) / elapsed,
        "prefix_hit_rate": sum(r[3] for r in log.requests) / prompt if prompt else 0.0,
    }


def _pool(ctx: BenchContext, router: str = "least_requests", **kwargs: Any) -> EnginePool:
    engine_kwargs = ENGINE_KWARGS | {"kv_cache_space_gib": KV_GIB} | kwargs
    return EnginePool.vllm(ctx.model_path, 2, router=router, **engine_kwargs)


def _routing(ctx: BenchContext, batches: int) -> Figures:
    figures: Figures = {}
    arms = {"sticky": "least_requests", "sticky_tokens": "least_tokens", "random": "random"}
    reps: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    pools = {arm: _pool(ctx, router=router) for arm, router in arms.items()}
    try:
        for rep in range(ctx.repeats_for()):
            for arm, pool in pools.items():
                reps[arm].append(_tokens_per_s(ctx, pool, batches, seed=100 + rep))
    finally:
        for pool in pools.values():
            pool.close()
    for arm, runs in reps.items():
        for key in runs[0]:
            figures[f"pool_{arm}_{key}"] = rounded(median([r[key] for r in runs]))
    for arm, key in (
        ("random", "pool_sticky_vs_random"),
        ("sticky_tokens", "pool_requests_vs_tokens"),
    ):
        pairs = zip(reps["sticky"], reps[arm], strict=True)
        figures[key] = rounded(median([s["tokens_per_s"] / o["tokens_per_s"] for s, o in pairs]))
    return figures


def _shrink_expand(ctx: BenchContext) -> Figures:
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(str(ctx.model_path)).state_dict()
    rows: list[dict[str, float]] = []
    pool = _pool(ctx)
    try:
        for rep in range(ctx.repeats_for()):
            log = RequestLog(pool)
            config = _config(ctx.quick, seed=200 + rep).replace(
                sampling=SamplingParams(max_tokens=64, ignore_eos=True)
            )
            with RolloutPipeline(config, log, ctx.tokenizer) as pipe:  # type: ignore[arg-type]
                thread = threading.Thread(target=pipe.get_batch)
                thread.start()
                while not any(load.rank == 1 and load.requests for load in pool.loads()):
                    time.sleep(0.002)  # the bench waits for requests on rank 1
                t0 = time.perf_counter()
                shrunk = pool.shrink([1])
                t1 = time.perf_counter()
                thread.join()
                durations = [end - start for start, end, *_ in log.requests]
                spanning = [end - s for s, end, *_ in log.requests if s < t1 and end > t0]
                pipe.suspend()
                pipe.update_weights(weights)
                loaded = pool.expand([1])
            pool.shrink([1])
            pool.update_weights(weights, version=0)  # back to the checkpoint's version
            skipped = pool.expand([1], skip_load=True)
            rows.append(
                {
                    "shrink_ms": shrunk["shrink_duration_ms"],
                    "rerouted": float(shrunk["aborted"]),
                    "shrink_stall_ms": 1000 * max(spanning, default=0.0),
                    "request_median_ms": 1000 * statistics.median(durations),
                    "expand_load_ms": loaded["expand_duration_ms"],
                    "expand_skip_load_ms": skipped["expand_duration_ms"],
                }
            )
    finally:
        pool.close()
    return {f"pool_{k}": rounded(median([r[k] for r in rows])) for k in rows[0]}


def _tokens_per_s_and_cores(
    ctx: BenchContext, engine: Any, batches: int
) -> tuple[float, float, float]:
    """Pipeline tokens/s on ``engine``, and the cores this process and its child
    processes (the engine cores of multiprocess engines) used meanwhile."""
    me = psutil.Process()

    def cpu() -> tuple[float, float]:
        kids = sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True))
        return sum(me.cpu_times()[:2]), kids

    (own0, kids0), start = cpu(), time.perf_counter()
    speed = _tokens_per_s(ctx, engine, batches, seed=300)["tokens_per_s"]
    (own1, kids1), wall = cpu(), time.perf_counter() - start
    return speed, (own1 - own0) / wall, (kids1 - kids0) / wall


def _engine_16_vs_32(engine: Any) -> float:
    """One engine's tokens/s at 16 requests at once ÷ at 32 (FrozenLake-sized prompts)."""
    params = SamplingParams(max_tokens=48, temperature=1.0, ignore_eos=True)
    prompts = [[*range(5, 300), 7 + i] for i in range(32)]
    engine.generate_batch(prompts[:8], params)  # warm
    speed = {}
    for n in (16, 32):
        start = time.perf_counter()
        gens = engine.generate_batch(prompts[:n], params)
        speed[n] = sum(g.num_tokens for g in gens) / (time.perf_counter() - start)
    return speed[16] / speed[32]


def _one_vs_two(ctx: BenchContext, batches: int) -> Figures:
    figures: Figures = {}
    for layout, multiprocess in (("inproc", False), ("multiprocess", True)):
        kwargs = ENGINE_KWARGS | {"kv_cache_space_gib": KV_GIB, "multiprocess": multiprocess}
        one = VLLMEngine(ctx.model_path, **kwargs)
        try:
            single, *cores_1 = _tokens_per_s_and_cores(ctx, one, batches)
            if multiprocess:
                figures["pool_engine_16_vs_32"] = rounded(_engine_16_vs_32(one))
        finally:
            one.close()
        pool = EnginePool.vllm(ctx.model_path, 2, **kwargs)
        try:
            double, *cores_2 = _tokens_per_s_and_cores(ctx, pool, batches)
        finally:
            pool.close()
        if multiprocess:
            for n, (driver, engines) in ((1, cores_1), (2, cores_2)):
                figures[f"pool_multiprocess_{n}_driver_cores"] = rounded(driver)
                figures[f"pool_multiprocess_{n}_engine_cores"] = rounded(engines)
        figures[f"pool_{layout}_1_tokens_per_s"] = rounded(single)
        figures[f"pool_{layout}_2_tokens_per_s"] = rounded(double)
        figures[f"pool_{layout}_ratio"] = rounded(double / single)
        ctx.log(f"  {layout}: 1 engine {single:.0f} tok/s, 2 engines {double:.0f} tok/s")
    return figures


def run(ctx: BenchContext) -> Figures:
    batches = ctx.size(smoke=1, quick=2, full=4)
    figures: Figures = {"pool_batches": batches}
    figures.update(_routing(ctx, batches))
    ctx.log(
        f"  sticky {figures['pool_sticky_tokens_per_s']} tok/s, hit rate "
        f"{figures['pool_sticky_prefix_hit_rate']}; random {figures['pool_random_tokens_per_s']}"
        f" tok/s, hit rate {figures['pool_random_prefix_hit_rate']}"
    )
    figures.update(_shrink_expand(ctx))
    ctx.log(
        f"  shrink {figures['pool_shrink_ms']} ms, expand {figures['pool_expand_load_ms']} ms"
        f" (skip_load {figures['pool_expand_skip_load_ms']} ms), stall "
        f"{figures['pool_shrink_stall_ms']} ms vs median {figures['pool_request_median_ms']} ms"
    )
    figures.update(_one_vs_two(ctx, batches))
    return figures
