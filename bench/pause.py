"""Benchmark 4: suspend / weight sync / resume with 64 requests in flight.

A FrozenLake pipeline (``concurrency=64``, one long fixed-length turn per episode) runs
in a consumer thread. Once 64 requests are in the engine, each repeat does what a
trainer does between steps, from the main thread:

* ``pause_ms`` — ``RolloutPipeline.suspend()`` (mode ``keep``: close the admission
  gate, pause the engine between two steps). When it returns the engine is quiescent;
  the benchmark checks that no in-flight request gains a token in the next 100 ms
  (``pause_quiescent``; reads the in-process vLLM backend's request table).
* ``weight_sync_ms`` — ``RolloutPipeline.update_weights(model)`` with the tiny model
  loaded by transformers (the "trainer's" copy): state dict → vLLM worker
  ``reload_weights``, prefix cache reset, version bump.
* ``resume_first_token_ms`` — from ``resume()`` to the first token generated after
  it: a 1-token probe request is queued on the paused engine before ``resume()``, and
  the time until it completes is measured. It shares the first steps after resume
  with the 64 resumed requests, whose KV cache vLLM recomputes after a weight change
  (``reset_prefix_cache(reset_running_requests=True)``).
  ``resume_first_token_no_sync_ms`` is the same after a suspend without a weight sync
  (the KV cache survives), measured in the same repeat.

After the repeats, every group is cancelled (``PipelineSignals.cancel_group``) so the
run ends without generating the rest. Medians over repeats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from bench.common import BenchContext, Figures, median, rounded
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

IN_FLIGHT = 64


class InFlight:
    """Engine wrapper counting ``generate`` calls in progress (public API only)."""

    def __init__(self, engine: Engine) -> None:
        self.inner = engine
        self.count = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def is_paused(self) -> bool:
        return self.inner.is_paused

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        with self._lock:
            self.count += 1
        try:
            return await self.inner.generate(prompt_ids, params)
        finally:
            with self._lock:
                self.count -= 1


def _backend(engine: Engine) -> Any:
    return getattr(engine, "_backend", None)


def tokens_in_flight(engine: Engine) -> int | None:
    """Tokens generated so far by the engine's active requests (in-process vLLM only)."""
    active = getattr(_backend(engine), "active", None)
    if active is None:
        return None
    return sum(len(r.tokens) for r in list(active.values()))


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.perf_counter() + timeout
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"pause benchmark: timed out after {timeout}s waiting for {what}")
        time.sleep(0.002)


def resume_with_probe(
    ctx: BenchContext, pipe: RolloutPipeline, probe_prompt: list[int]
) -> tuple[float, float]:
    """Queue a 1-token probe on the paused engine, ``resume()``; returns (seconds in
    ``resume()``, seconds from ``resume()`` to the probe's token)."""
    done: list[float] = []

    def send_probe() -> None:
        ctx.engine.generate_batch([probe_prompt], SamplingParams(max_tokens=1))
        done.append(time.perf_counter())

    prober = threading.Thread(target=send_probe, name="bench-probe")
    prober.start()
    queued = getattr(_backend(ctx.engine), "queued", None)
    if queued is not None:
        wait_for(lambda: len(queued) > 0, 10, "the probe to be queued")
    else:
        time.sleep(0.1)
    t0 = time.perf_counter()
    pipe.resume()
    resume_s = time.perf_counter() - t0
    prober.join()
    return resume_s, done[0] - t0


def run(ctx: BenchContext) -> Figures:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ctx.model_path))
    engine = InFlight(ctx.engine)
    config = PipelineConfig(
        envs="frozenlake",
        group_size=4,
        batch_size=IN_FLIGHT,
        num_groups=IN_FLIGHT // 4,
        max_turns=1,
        max_length=int(getattr(ctx.engine, "max_model_len", 2048)),
        concurrency=IN_FLIGHT,
        sampling=SamplingParams(max_tokens=1024, ignore_eos=True),
    )
    pause_ms, sync_ms, first_ms, resume_ms, quiet = [], [], [], [], []
    first_nosync_ms: list[float] = []
    probe_prompt = ctx.tokenizer("probe after resume")["input_ids"]
    pipe = RolloutPipeline(config, engine, ctx.tokenizer)
    consumer = threading.Thread(target=pipe.get_batch, args=(-1,), name="bench-consumer")
    consumer.start()
    try:
        for rep in range(ctx.repeats_for()):
            for sync in (False, True):
                wait_for(lambda: engine.count >= IN_FLIGHT, 120, f"{IN_FLIGHT} requests in flight")
                time.sleep(0.2)  # let them decode a little
                t0 = time.perf_counter()
                pipe.suspend("keep")
                suspend_s = time.perf_counter() - t0
                before = tokens_in_flight(ctx.engine)
                time.sleep(0.1)
                after = tokens_in_flight(ctx.engine)
                in_flight = engine.count
                if sync:
                    t0 = time.perf_counter()
                    pipe.update_weights(model)
                    sync_ms.append(1e3 * (time.perf_counter() - t0))
                resume_s, first_s = resume_with_probe(ctx, pipe, probe_prompt)
                if sync:
                    pause_ms.append(1e3 * suspend_s)
                    quiet.append(before is not None and before == after)
                    resume_ms.append(1e3 * resume_s)
                    first_ms.append(1e3 * first_s)
                else:
                    first_nosync_ms.append(1e3 * first_s)
            ctx.log(
                f"  pause rep {rep}: {in_flight} in flight, suspend {pause_ms[-1]:.1f} ms "
                f"(quiescent: {quiet[-1]}), sync {sync_ms[-1]:.1f} ms, resume to first token "
                f"{first_ms[-1]:.1f} ms ({first_nosync_ms[-1]:.1f} ms without a sync)"
            )
    finally:
        if pipe.suspension.is_suspended:
            pipe.resume()
        for group in range(IN_FLIGHT // 4):
            pipe.nodes.signals.cancel_group(group)
        consumer.join(timeout=120)
        pipe.close()
    return {
        "pause_ms": rounded(median(pause_ms)),
        "pause_quiescent": all(quiet),
        "weight_sync_ms": rounded(median(sync_ms)),
        "resume_ms": rounded(median(resume_ms)),
        "resume_first_token_ms": rounded(median(first_ms)),
        "resume_first_token_no_sync_ms": rounded(median(first_nosync_ms)),
        "pause_in_flight": IN_FLIGHT,
    }
