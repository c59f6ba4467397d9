"""Benchmark 17: weight-update MB/s into Ray engine actors, through the object store
against by broadcast (``weight_sync="broadcast"``, gloo on CPU), side by side.

* **The tiny model (1.84 MB) on a real engine**: two ``RayEngine``s hosting ``VLLMEngine``
  on the tiny model, one per path; ``update_weights(state_dict)`` timed to return (the
  weights reach the actor and vLLM has reloaded them).
* **100 MB and 500 MB, synthetic named tensors** (fp32, 16 MiB each): a real engine
  cannot hold them here, so each path's actor hosts a *sink*: an engine whose
  ``update_weights`` copies every tensor into buffers of its own (what a model's load
  does with the bytes: read each one once) and bumps the version. What is timed is the
  transport into the engine host actor plus that hand-off: for the object store,
  ``ray.put`` on the driver, the actor's read of the shared-memory copy, the copy in
  the sink; for broadcast, packing into 256 MiB buckets, the metadata call, the gloo
  broadcast over loopback TCP, the copy in the sink.

Arms alternate within each repeat (object store, then broadcast), each after an untimed
first update (it forms the broadcast group and allocates the sink's buffers). Figures:
``weight_sync_{object_store,broadcast}_mb_per_s_{tiny,100,500}mb`` (the tiny model's
size in ``weight_sync_tiny_model_mb``: 1.84 MB as transformers' fp32 state dict, tied
``lm_head`` included), the ratios ``weight_sync_broadcast_over_object_store_{...}``
(MB/s), and ``weight_sync_{path}_7b_s``: 14 GB (7B in bf16) at the path's 500 MB rate
(its fixed cost included: a fit of fixed cost and rate from two sizes came out negative
on this noisy machine), transport and hand-off only, on one node; a real 7B load in
vLLM adds its own time on both paths.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench.common import BenchContext, Figures, median, rounded

TENSOR_BYTES = 16 << 20
SIZES_MB = {"100": 100, "500": 500}


def make_sink() -> Any:
    """A receive-only engine (runs in the actor): keeps a copy of every tensor it gets."""
    import torch

    from rollpipe.engines.scripted import ScriptedEngine

    class SinkEngine(ScriptedEngine):
        def __init__(self) -> None:
            super().__init__(lambda prompt_ids, params: [0])
            self.buffers: dict[str, torch.Tensor] = {}

        def update_weights(self, weights: Any, version: int | None = None) -> int:
            items = weights.items() if isinstance(weights, dict) else weights
            for name, tensor in items:
                held = self.buffers.get(name)
                if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                    held = self.buffers[name] = torch.empty_like(tensor)
                held.copy_(tensor)
            return super().update_weights({"sink": torch.zeros(1)}, version)

    return SinkEngine()


def synthetic(megabytes: int) -> dict[str, Any]:
    """``megabytes`` MB of named fp32 tensors, 16 MiB each (the last one smaller)."""
    import torch

    left, out = megabytes * 10**6, {}
    while left > 0:
        n = min(TENSOR_BYTES, left) // 4
        out[f"layers.{len(out)}.weight"] = torch.randn(n)
        left -= n * 4
    return out


def _timed_updates(engines: dict[str, Any], weights: Any, repeats: int) -> dict[str, float]:
    """Median seconds of ``update_weights`` per path, the paths alternating."""
    for engine in engines.values():
        engine.update_weights(weights)  # untimed: the group forms, the buffers are made
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.update_weights(weights)
            times[name].append(time.perf_counter() - start)
    return {name: median(ts) for name, ts in times.items()}


def run(ctx: BenchContext) -> Figures:
    import functools

    import ray
    from transformers import AutoModelForCausalLM

    from rollpipe.engines.ray_engine import RayEngine
    from rollpipe.engines.vllm import VLLMEngine

    repeats = ctx.repeats_for()
    sizes = {"4": 4} if ctx.smoke else SIZES_MB
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # make_sink, in the actor
    store_mb = 80 if ctx.smoke else 1400
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=store_mb << 20,
    )
    figures: Figures = {"weight_sync_repeats": repeats}
    seconds: dict[str, dict[str, float]] = {}
    try:
        if not ctx.smoke:  # the real engine's actors take a minute to start: not in smoke
            path = str(ctx.model_path)
            make = functools.partial(VLLMEngine, path, kv_cache_space_gib=0.25)
            state = AutoModelForCausalLM.from_pretrained(path).state_dict()
            tiny_mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
            engines = {p: RayEngine(make, weight_sync=p) for p in ("object_store", "broadcast")}
            try:
                seconds["tiny"] = _timed_updates(engines, state, repeats)
            finally:
                for engine in engines.values():
                    engine.close()
            figures["weight_sync_tiny_model_mb"] = rounded(tiny_mb)
        for label, mb in sizes.items():  # new sinks per size: a channel keeps one layout
            sinks = {p: RayEngine(make_sink, weight_sync=p) for p in ("object_store", "broadcast")}
            try:
                seconds[label] = _timed_updates(sinks, synthetic(mb), repeats)
            finally:
                for engine in sinks.values():
                    engine.close()
    finally:
        ray.shutdown()
    megabytes = {"tiny": figures.get("weight_sync_tiny_model_mb", 0.0), **sizes}
    for label, by_path in seconds.items():
        for path, s in by_path.items():
            figures[f"weight_sync_{path}_ms_{label}mb"] = rounded(1000 * s)
            figures[f"weight_sync_{path}_mb_per_s_{label}mb"] = rounded(megabytes[label] / s)
        figures[f"weight_sync_broadcast_over_object_store_{label}mb"] = rounded(
            by_path["object_store"] / by_path["broadcast"]
        )
    if "500" in seconds:  # the largest update's rate, fixed costs included, applied to 7B
        for path in ("object_store", "broadcast"):
            figures[f"weight_sync_{path}_7b_s"] = rounded(seconds["500"][path] * 14e9 / 500e6)
    for label in seconds:
        ctx.log(
            f"  {label} (MB): object store "
            f"{figures[f'weight_sync_object_store_mb_per_s_{label}mb']} MB/s, broadcast "
            f"{figures[f'weight_sync_broadcast_mb_per_s_{label}mb']} MB/s"
        )
    return figures


if __name__ == "__main__":  # python -m bench.weight_sync [--smoke]
    from bench.run import main

    main(["--only", "weight_sync", *sys.argv[1:]])
