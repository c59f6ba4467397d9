"""Benchmark 9: remote engines against the in-process engine, same workload, side by side.

* ``remote_ray_ratio`` / ``remote_server_ratio`` — tokens/s of a FrozenLake pipeline on a
  ``RayEngine`` (vLLM in a Ray actor on a local cluster) and on a ``ServerEngine`` (a
  ``vllm serve`` process on this machine) ÷ the in-process ``VLLMEngine``, each arm on
  its own engine with the same config and seed.
* ``remote_bytes_per_batch`` / ``remote_bytes_per_trajectory`` — payload bytes that cross
  the process boundary per batch: each request's prompt ids and sampling parameters
  and each reply's tokens, logprobs and versions, pickled (what Ray ships; HTTP's JSON
  is within a small factor). Framing (Ray's task specs, HTTP headers) is not counted.
* ``remote_ray_weight_sync_ms`` — ``update_weights`` through Ray for the tiny model: one
  ``ray.put`` of the state dict, then the actor reloads it (1.6 MB: almost all of it is
  fixed per-call cost). ``remote_object_store_gb_per_s``: ``ray.put`` of 256 MB of
  tensors and a task reading them, on this node. ``remote_weight_sync_7b_s`` is an
  estimate, not a measurement: the tiny model's sync time plus 14 GB (7B in bf16) at
  that rate, on one node; across nodes add the network transfer.
"""

from __future__ import annotations

import functools
import pickle
import time
from typing import Any

from bench.common import BenchContext, Figures, median, rounded
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.engines.vllm import VLLMEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

KV_GIB = 0.25
BYTES_7B_BF16 = 7e9 * 2


class PayloadLog:
    """The engine under test, adding up the pickled size of each request and reply."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.bytes = 0
        self.tokens = 0

    async def generate(self, prompt_ids: Any, params: SamplingParams) -> Generation:
        gen = await self._engine.generate(prompt_ids, params)
        self.bytes += len(pickle.dumps((list(prompt_ids), params))) + len(pickle.dumps(gen))
        self.tokens += gen.num_tokens
        return gen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _run(ctx: BenchContext, engine: Any, batches: int) -> dict[str, float]:
    config = PipelineConfig(
        envs="frozenlake",
        group_size=4,
        batch_size=16,
        max_turns=4,
        concurrency=16,
        seed=9,
        sampling=SamplingParams(max_tokens=24),
    )
    log = PayloadLog(engine)
    with RolloutPipeline(config, log, ctx.tokenizer) as pipe:  # type: ignore[arg-type]
        pipe.get_batch()  # warm
        log.bytes = log.tokens = 0
        start = time.perf_counter()
        rows = sum(len(pipe.get_batch()) for _ in range(batches))
        elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": log.tokens / elapsed,
        "bytes_per_batch": log.bytes / batches,
        "bytes_per_trajectory": log.bytes / rows,
    }


def _object_store_rate(megabytes: int = 256) -> float:
    """GB/s of ``ray.put`` of ``megabytes`` of tensors plus a task that reads them all."""
    import ray
    import torch

    @ray.remote(num_cpus=0)
    def total(tensors: list[torch.Tensor]) -> float:
        return float(sum(t.sum().item() for t in tensors))

    tensors = [torch.ones(megabytes * (1 << 20) // 4 // 8) for _ in range(8)]
    start = time.perf_counter()
    ray.get(total.remote(ray.put(tensors)))
    return megabytes * (1 << 20) / 1e9 / (time.perf_counter() - start)


def run(ctx: BenchContext) -> Figures:
    import ray
    from transformers import AutoModelForCausalLM

    from rollpipe.engines.ray_engine import RayEngine
    from rollpipe.engines.server import ServerEngine, start_vllm_server

    batches = ctx.size(smoke=1, quick=3, full=6)
    path = str(ctx.model_path)
    figures: Figures = {"remote_batches": batches}
    local = VLLMEngine(path, kv_cache_space_gib=KV_GIB)
    try:
        base = [_run(ctx, local, batches) for _ in range(ctx.repeats_for())]
    finally:
        local.close()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        ignore_reinit_error=True,
    )
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    remote = RayEngine(functools.partial(VLLMEngine, path, kv_cache_space_gib=KV_GIB))
    try:
        on_ray = [_run(ctx, remote, batches) for _ in range(ctx.repeats_for())]
        syncs = []
        for _ in range(ctx.repeats_for()):
            start = time.perf_counter()
            remote.update_weights(state)
            syncs.append(time.perf_counter() - start)
        rate_gb_s = median([_object_store_rate() for _ in range(ctx.repeats_for())])
    finally:
        remote.close()
        ray.shutdown()
    server = start_vllm_server(path, kv_cache_space_gib=KV_GIB)
    try:
        with ServerEngine(server.url) as client:
            on_server = [_run(ctx, client, batches) for _ in range(ctx.repeats_for())]
    finally:
        server.close()
    rate = median([b["tokens_per_s"] for b in base])
    figures["remote_local_tokens_per_s"] = rounded(rate)
    for name, arm in (("ray", on_ray), ("server", on_server)):
        arm_rate = median([r["tokens_per_s"] for r in arm])
        figures[f"remote_{name}_tokens_per_s"] = rounded(arm_rate)
        figures[f"remote_{name}_ratio"] = rounded(arm_rate / rate)
    figures["remote_bytes_per_batch"] = rounded(median([r["bytes_per_batch"] for r in on_ray]))
    figures["remote_bytes_per_trajectory"] = rounded(
        median([r["bytes_per_trajectory"] for r in on_ray])
    )
    sync_s = median(syncs)
    figures["remote_model_bytes"] = model_bytes
    figures["remote_ray_weight_sync_ms"] = rounded(1000 * sync_s)
    figures["remote_object_store_gb_per_s"] = rounded(rate_gb_s)
    figures["remote_weight_sync_7b_s"] = rounded(sync_s + BYTES_7B_BF16 / (rate_gb_s * 1e9))
    ctx.log(
        f"  ray {figures['remote_ray_ratio']}x, server {figures['remote_server_ratio']}x of "
        f"in-process; {figures['remote_bytes_per_batch']} B/batch; weight sync "
        f"{figures['remote_ray_weight_sync_ms']} ms, object store "
        f"{figures['remote_object_store_gb_per_s']} GB/s (7B estimated "
        f"{figures['remote_weight_sync_7b_s']} s)"
    )
    return figures
