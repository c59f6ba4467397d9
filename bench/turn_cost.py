"""Benchmark 11: rollpipe's own CPU per turn, as conversations grow and episodes multiply.

The engine is a ``ScriptedEngine`` (every answer instant, a fixed response), so all the
CPU spent is rollpipe's: building each turn's prompt, checking it, recording the turn,
admission, grouping and collation. The env (``LongChat``) answers every action with a
fixed observation of about ``OBS_TOKENS`` tokens and never ends an episode, so an episode
of ``T`` turns ends with a context of about ``T * (OBS_TOKENS + RESPONSE_TOKENS)`` tokens.

Figures (process CPU time, ``time.process_time``, and wall time, over one ``get_batch``
of every episode, divided by the turns taken; the engine's share is in that CPU too):

* ``turn_cpu_us_{T}turns``: µs per turn at ``T`` turns per episode (8, 32, 128;
  ``TURN_SWEEP_EPISODES`` episodes in flight, as issue 28's probe), with
  ``turn_context_tokens_{T}turns`` the final context length, and ``turns_per_s_{T}turns``
  the wall-clock turns per second. A per-turn cost that grows with ``T`` is work that
  grows with the history: ``turn_cpu_ratio_128_32`` (target ≤ 1.2) and
  ``turns_per_s_ratio_128_32`` (wall, target ≥ 0.8) say how much.
* ``turn_cpu_us_{N}inflight``: µs per turn with ``N`` episodes in flight (1, 64, 1024,
  4096; 8 turns each); ``turns_per_cpu_s_{N}inflight`` the turns one core sustains
  (1e6 / that; target ≥ 10,000 at 1024) and ``turns_per_s_{N}inflight`` the wall rate.
* ``rss_kb_per_episode_{N}inflight``: the resident memory the run grew by at its peak
  (sampled by the engine every 64 requests and once more with the batch built, its rows
  included), per episode in flight; freed heap is handed back to the OS before each
  run (else a run reuses what earlier runs freed and seems to grow by nothing).
* The run holds torch to one intra-op thread (restored after): the figures are what one
  core does. With torch's default threads on a busy two-core machine, collation's
  tensor fills spin OpenMP threads and took ten times the CPU (64 episodes x 8 turns:
  about 220 µs per turn in collation alone, 22 with one thread).
* ``episode_fixed_cpu_us`` and ``turn_marginal_cpu_us``: the CPU of an episode as
  ``fixed + turns * marginal``, the line through 1-turn and 8-turn episodes
  (``TURN_SWEEP_EPISODES`` in flight). The fixed part is what every episode costs
  whatever its length: admission, reset, first prompt, the trajectory record, its row
  and its share of the batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from typing import Any

import psutil

from bench.common import BenchContext, Figures, median, one_torch_thread, rounded
from rollpipe.engines.records import SamplingParams
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

OBS_TOKENS = 200
RESPONSE_TOKENS = 32
TURN_SWEEP_EPISODES = 64
RSS_EVERY = 64


class LongChat:
    """A conversation that never ends: every observation is the same long paragraph."""

    blocking = False  # microseconds per call, never waits: runs inline

    def __init__(self, words: int = OBS_TOKENS) -> None:
        self.text = " ".join(f"w{i % 50}" for i in range(words))

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return self.text, {}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self.text, 0.0, False, False, {"action_valid": True}

    def close(self) -> None:
        return None


class _Peak:
    """The engine's policy: a fixed response; samples the process RSS as it answers."""

    def __init__(self, response: list[int]) -> None:
        self.response = response
        self.process = psutil.Process()
        self.calls = 0
        self.peak = 0

    def __call__(self, prompt: list[int], params: SamplingParams) -> list[int]:
        self.calls += 1
        if self.calls % RSS_EVERY == 0:
            self.peak = max(self.peak, self.process.memory_info().rss)
        return self.response


def _response(tokenizer: Any) -> list[int]:
    ids = tokenizer("Action: Up. " * RESPONSE_TOKENS, add_special_tokens=False)["input_ids"]
    return [*ids[: RESPONSE_TOKENS - 1], tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc's ``malloc_trim``), so
    the resident memory a run grows by is its own."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _one_run(ctx: BenchContext, episodes: int, turns: int) -> dict[str, float]:
    policy = _Peak(_response(ctx.tokenizer))
    config = PipelineConfig(
        envs="bench.turn_cost:LongChat",
        group_size=1,
        num_groups=episodes,
        batch_size=episodes,
        concurrency=min(episodes, 65536),
        max_turns=turns,
        max_length=2**17,
        sampling=SamplingParams(max_tokens=RESPONSE_TOKENS),
    )
    with (
        ScriptedEngine(policy) as engine,
        RolloutPipeline(config, engine, ctx.tokenizer) as pipe,
    ):
        _release_freed_memory()  # else this run reuses the heap earlier runs freed
        base = psutil.Process().memory_info().rss
        cpu, wall = time.process_time(), time.perf_counter()
        batch = pipe.get_batch()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        policy.peak = max(policy.peak, psutil.Process().memory_info().rss)  # batch held
    assert batch is not None and len(batch) == episodes
    taken = int(batch.batch["response_mask"].sum()) // RESPONSE_TOKENS
    context = int(batch.batch["attention_mask"][0].sum())
    return {
        "us_per_turn": 1e6 * cpu / max(taken, 1),
        "us_per_episode": 1e6 * cpu / episodes,
        "turns_per_s": taken / wall,
        "context": context,
        "rss_kb_per_episode": max(policy.peak - base, 0) / 1024 / episodes,
    }


def _fixed_cost(ctx: BenchContext, repeats: int) -> tuple[float, float]:
    """(fixed µs per episode, µs per turn): the line through 1-turn and 8-turn episodes."""
    one, eight = (
        median([_one_run(ctx, TURN_SWEEP_EPISODES, t)["us_per_episode"] for _ in range(repeats)])
        for t in (1, 8)
    )
    marginal = (eight - one) / 7
    return one - marginal, marginal


def run(ctx: BenchContext) -> Figures:
    with one_torch_thread():
        return _run(ctx)


def _run(ctx: BenchContext) -> Figures:
    turn_sweep = ctx.size(smoke=(8,), quick=(8, 32, 128), full=(8, 32, 128))
    inflight = ctx.size(smoke=(1, 4), quick=(1, 64, 1024), full=(1, 64, 1024, 4096))
    sweep_episodes = 4 if ctx.smoke else TURN_SWEEP_EPISODES
    repeats = ctx.repeats_for(3)
    out: Figures = {}
    for turns in turn_sweep:
        runs = [_one_run(ctx, sweep_episodes, turns) for _ in range(repeats)]
        out[f"turn_cpu_us_{turns}turns"] = rounded(median([r["us_per_turn"] for r in runs]), 1)
        out[f"turns_per_s_{turns}turns"] = rounded(median([r["turns_per_s"] for r in runs]))
        out[f"turn_context_tokens_{turns}turns"] = int(runs[0]["context"])
        ctx.log(
            f"  {turns} turns: {out[f'turn_cpu_us_{turns}turns']} µs/turn, "
            f"{out[f'turns_per_s_{turns}turns']} turns/s"
        )
    if "turn_cpu_us_128turns" in out:
        cpu = out["turn_cpu_us_128turns"] / out["turn_cpu_us_32turns"]  # type: ignore[operator]
        wall = out["turns_per_s_128turns"] / out["turns_per_s_32turns"]  # type: ignore[operator]
        out["turn_cpu_ratio_128_32"], out["turns_per_s_ratio_128_32"] = rounded(cpu), rounded(wall)
        ctx.log(f"  128 ÷ 32 turns: CPU per turn {cpu:.2f}×, wall turns/s {wall:.2f}×")
    for n in inflight:
        runs = [_one_run(ctx, n, 8) for _ in range(repeats)]
        us = median([r["us_per_turn"] for r in runs])
        out[f"turn_cpu_us_{n}inflight"] = rounded(us, 1)
        out[f"turns_per_cpu_s_{n}inflight"] = rounded(1e6 / us)
        out[f"turns_per_s_{n}inflight"] = rounded(median([r["turns_per_s"] for r in runs]))
        rss = median([r["rss_kb_per_episode"] for r in runs])
        out[f"rss_kb_per_episode_{n}inflight"] = rounded(rss, 1)
        ctx.log(f"  {n} in flight: {out[f'turn_cpu_us_{n}inflight']} µs/turn, {rss:.0f} KB/ep")
    if not ctx.smoke:
        fixed, marginal = _fixed_cost(ctx, repeats)
        out["episode_fixed_cpu_us"] = rounded(fixed, 1)
        out["turn_marginal_cpu_us"] = rounded(marginal, 1)
        ctx.log(f"  per episode: {fixed:.0f} µs fixed + {marginal:.0f} µs per turn")
    return out
