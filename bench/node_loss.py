"""Benchmark 16: a node lost mid-batch, against the same pipeline's batch without a loss.

A Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``): a head
that hosts nothing of ours and two worker nodes, each hosting one ``RayEngine`` rank of
an ``EnginePool`` (custom resources ``engine_0`` / ``engine_1`` place them); envs run in
the driver. One pipeline runs throughout. Each round: a batch without a death, timed;
then a batch during which the ``engine_1`` node is SIGKILLed (``remove_node(...,
allow_graceful=False)``) as soon as rank 1 has requests in flight, timed from the kill
to the batch's return and from its start; then a new ``engine_1`` node and
``expand_sampler([1])`` bring the rank back for the next round (not timed).

Figures: ``node_loss_batch_s`` (median batch without a death), ``node_loss_death_to_batch_s``
(median time from the kill to the complete batch), ``node_loss_notice_s`` (from the kill
to the pool's taking rank 1 out: Ray failing the calls to the lost actor),
``node_loss_batch_with_death_s``,
``node_loss_ratio`` (median per round of the batch with a death ÷ the batch before it),
``node_loss_rerouted`` (requests re-sent per death), ``node_loss_rounds``.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

from bench.common import BenchContext, Figures, median, rounded
from bench.ray_nodes import ray_cluster
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.ray_engine import RayEngine, WeightStore
from rollpipe.engines.vllm import VLLMEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

KV_GIB = 0.25
DEADLINE_S = 300.0  # for a state that must come (the benchmark fails past it)


def _config(ctx: BenchContext) -> PipelineConfig:
    return PipelineConfig(
        group_size=2,
        batch_size=ctx.size(smoke=4, quick=16, full=32),
        max_turns=2,
        max_length=1024,
        concurrency=ctx.size(smoke=4, quick=8, full=16),
        seed=16,
        sampling={"max_tokens": ctx.size(smoke=64, quick=96, full=128), "ignore_eos": True},
    )


def _rank_engine(make: Any, store: WeightStore, rank: int) -> RayEngine:
    placed = {"resources": {f"engine_{rank}": 1}}
    return RayEngine(make, num_cpus=1, weights=store, actor_options=placed)


def _batch_with_death(
    pipe: RolloutPipeline, pool: EnginePool, kill: Any
) -> tuple[float, float, float]:
    """(start → batch, kill → batch, kill → rank 1 in ``failures()``) seconds: ``kill()``
    runs once rank 1 has requests in flight (both states checked every 2 ms: the latency
    of noticing them, not a guessed wait)."""
    done = threading.Event()
    out: dict[str, Any] = {}

    def fetch() -> None:
        try:
            out["batch"] = pipe.get_batch()
        except BaseException as exc:
            out["error"] = exc
        finally:
            out["end"] = time.perf_counter()
            done.set()

    start = time.perf_counter()
    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    deadline = start + DEADLINE_S
    while not any(load.rank == 1 and load.requests for load in pool.loads()):
        if done.is_set() or time.perf_counter() > deadline:
            raise RuntimeError("node_loss: the batch ended before rank 1 had a request")
        done.wait(0.002)
    killed = time.perf_counter()
    kill()
    while 1 not in pool.failures() and not done.is_set():
        if time.perf_counter() > killed + DEADLINE_S:
            raise RuntimeError("node_loss: the pool did not take the lost rank out")
        done.wait(0.002)
    noticed = time.perf_counter()
    if not done.wait(DEADLINE_S):
        raise RuntimeError(f"node_loss: no batch within {DEADLINE_S} s of the node's death")
    if "error" in out:
        raise out["error"]
    return out["end"] - start, out["end"] - killed, noticed - killed


def run(ctx: BenchContext) -> Figures:
    rounds = ctx.size(smoke=1, quick=2, full=3)
    config = _config(ctx)
    plain, with_death, to_batch, ratios, rerouted, notice = [], [], [], [], [], []
    with ray_cluster(("engine_0", "engine_1")) as nodes:  # another bench's session ends
        make = functools.partial(VLLMEngine, str(ctx.model_path), kv_cache_space_gib=KV_GIB)
        pool = EnginePool(functools.partial(_rank_engine, make, WeightStore()), 2)
        with pool, RolloutPipeline(config, pool, ctx.tokenizer) as pipe:
            pipe.get_batch()  # warm: both ranks have served, the envs are built
            for r in range(rounds):
                if r:  # the lost rank back on a new node
                    nodes.add("engine_1")
                    pipe.expand_sampler([1])
                start = time.perf_counter()
                pipe.get_batch()
                plain.append(time.perf_counter() - start)
                before = pool.rerouted
                kill = functools.partial(nodes.kill, "engine_1")
                whole, after_kill, noticed = _batch_with_death(pipe, pool, kill)
                notice.append(noticed)
                with_death.append(whole)
                to_batch.append(after_kill)
                ratios.append(whole / plain[-1])
                rerouted.append(pool.rerouted - before)
                ctx.log(
                    f"  round {r}: batch {plain[-1]:.2f} s; with a node lost {whole:.2f} s "
                    f"({whole / plain[-1]:.2f}x), kill -> batch {after_kill:.2f} s, "
                    f"kill -> rank out {noticed:.2f} s, {rerouted[-1]} requests re-sent"
                )
    figures: Figures = {
        "node_loss_rounds": rounds,
        "node_loss_trajectories": config.batch_size,
        "node_loss_batch_s": rounded(median(plain)),
        "node_loss_batch_with_death_s": rounded(median(with_death)),
        "node_loss_death_to_batch_s": rounded(median(to_batch)),
        "node_loss_ratio": rounded(median(ratios)),
        "node_loss_notice_s": rounded(median(notice)),
        "node_loss_rerouted": rounded(median(rerouted)),
    }
    ctx.log(
        f"  node lost mid-batch: {figures['node_loss_batch_with_death_s']} s vs "
        f"{figures['node_loss_batch_s']} s ({figures['node_loss_ratio']}x); death -> batch "
        f"{figures['node_loss_death_to_batch_s']} s"
    )
    return figures
