"""Benchmark 11: rollpipe's own CPU per turn, as conversations grow and episodes multiply.

The engine is a ``ScriptedEngine`` (every answer instant, a fixed response), so all the
CPU spent is rollpipe's: building each turn's prompt, checking it, recording the turn,
admission, grouping and collation. The env (``LongChat``) answers every action with a
fixed observation of about ``OBS_TOKENS`` tokens and never ends an episode, so an episode
of ``T`` turns ends with a context of about ``T * (OBS_TOKENS + RESPONSE_TOKENS)`` tokens.

Figures (process CPU time, ``time.process_time``, over one ``get_batch`` of every
episode, divided by the turns taken):

* ``turn_cpu_us_{T}turns``: µs per turn at ``T`` turns per episode (8, 32, 128;
  ``TURN_SWEEP_EPISODES`` episodes in flight), with ``turn_context_tokens_{T}turns`` the
  final context length. A per-turn cost that grows with ``T`` is work that grows with
  the history.
* ``turn_cpu_us_{N}inflight``: µs per turn with ``N`` episodes in flight (1, 64, 1024,
  4096; 8 turns each).
* ``rss_kb_per_episode_{N}inflight``: the resident memory the run grew by at its peak
  (sampled by the engine every 64 requests), per episode in flight.
"""

from __future__ import annotations

import time
from typing import Any

import psutil

from bench.common import BenchContext, Figures, median, rounded
from rollpipe.engines.records import SamplingParams
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

OBS_TOKENS = 200
RESPONSE_TOKENS = 32
TURN_SWEEP_EPISODES = 16
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
        base = psutil.Process().memory_info().rss
        cpu = time.process_time()
        batch = pipe.get_batch()
        cpu = time.process_time() - cpu
    assert batch is not None and len(batch) == episodes
    taken = int(batch.batch["response_mask"].sum()) // RESPONSE_TOKENS
    context = int(batch.batch["attention_mask"][0].sum())
    return {
        "us_per_turn": 1e6 * cpu / max(taken, 1),
        "context": context,
        "rss_kb_per_episode": max(policy.peak - base, 0) / 1024 / episodes,
    }


def run(ctx: BenchContext) -> Figures:
    turn_sweep = ctx.size(smoke=(8,), quick=(8, 32, 128), full=(8, 32, 128))
    inflight = ctx.size(smoke=(1, 4), quick=(1, 64, 1024), full=(1, 64, 1024, 4096))
    repeats = ctx.repeats_for(3)
    out: Figures = {}
    for turns in turn_sweep:
        runs = [_one_run(ctx, TURN_SWEEP_EPISODES, turns) for _ in range(repeats)]
        out[f"turn_cpu_us_{turns}turns"] = rounded(median([r["us_per_turn"] for r in runs]), 1)
        out[f"turn_context_tokens_{turns}turns"] = int(runs[0]["context"])
        ctx.log(f"  {turns} turns: {out[f'turn_cpu_us_{turns}turns']} µs/turn")
    for n in inflight:
        runs = [_one_run(ctx, n, 8) for _ in range(repeats)]
        out[f"turn_cpu_us_{n}inflight"] = rounded(median([r["us_per_turn"] for r in runs]), 1)
        rss = median([r["rss_kb_per_episode"] for r in runs])
        out[f"rss_kb_per_episode_{n}inflight"] = rounded(rss, 1)
        ctx.log(f"  {n} in flight: {out[f'turn_cpu_us_{n}inflight']} µs/turn, {rss:.0f} KB/ep")
    return out
