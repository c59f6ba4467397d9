"""Benchmark 12: the OpenAI-compatible front door against the in-process engine call.

Same engine, same prompt, same sampling (``max_tokens`` tokens, ``ignore_eos``), arms run
side by side in one run:

* ``frontdoor_calls_ratio``: calls per second through the front door (the real
  ``openai.AsyncOpenAI`` client, one session key per concurrent caller) ÷ calls per second
  of ``await engine.generate`` directly, at ``CONCURRENCY`` callers.
* ``frontdoor_added_latency_ms``: median latency of one call at concurrency 1, front door
  minus direct: what the HTTP hop, rendering and recording add per call.
* ``agent_vs_text_trajectories_ratio``: trajectories/s of a 3-call agent episode
  (``AgentEnv``) ÷ the same three turns as a text env, through ``RolloutPipeline``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from bench.common import BenchContext, Figures, median, rounded
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.engines.records import SamplingParams
from rollpipe.envs import register
from rollpipe.frontdoor import AgentEnv, FrontDoor
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

MAX_TOKENS = 16
CONCURRENCY = 32
QUESTION = "What is 2 + 3?"
TURNS = 3


class ThreeTurns:
    """The text-env twin of ``three_calls``: the same question, then "Go on." twice."""

    blocking = False
    system_prompt = None

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return QUESTION, {}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        return "Go on.", 0.0, self.turn >= TURNS, False, {}

    def close(self) -> None:
        return None


async def three_calls(client: Any, task: Any) -> float:
    """An agent making ``TURNS`` calls on one growing conversation."""
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    for _ in range(TURNS):
        reply = await client.chat.completions.create(model="rollpipe", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "Go on."}]
    return 0.0


def _calls(ctx: BenchContext, n: int) -> dict[str, float]:
    import openai

    settings = EpisodeSettings(system_prompt=None, sampling={"max_tokens": MAX_TOKENS})
    chat = settings.chat_format(ctx.tokenizer)
    messages = [{"role": "user", "content": QUESTION}]
    prompt = chat.encode(chat.render_messages(messages, generation_prompt=True))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = ctx.engine
    out: dict[str, float] = {}
    with FrontDoor(engine, chat, settings) as door:
        keys = [door.open_session().key for _ in range(CONCURRENCY)]

        async def direct(concurrency: int) -> list[float]:
            gate = asyncio.Semaphore(concurrency)

            async def one() -> float:
                async with gate:
                    start = time.perf_counter()
                    await engine.generate(prompt, params)
                    return time.perf_counter() - start

            return await asyncio.gather(*(one() for _ in range(n)))

        async def front(concurrency: int) -> list[float]:
            clients = [
                openai.AsyncOpenAI(base_url=door.url, api_key=k, max_retries=0)
                for k in keys[:concurrency]
            ]
            left = list(range(n))
            latencies: list[float] = []

            async def worker(client: Any) -> None:
                while left:
                    left.pop()
                    start = time.perf_counter()
                    await client.chat.completions.create(
                        model="rollpipe",
                        messages=messages,
                        max_tokens=MAX_TOKENS,
                        extra_body={"ignore_eos": True},
                    )
                    latencies.append(time.perf_counter() - start)

            await asyncio.gather(*(worker(c) for c in clients))
            for client in clients:
                await client.close()
            return latencies

        for name, arm in (("direct", direct), ("frontdoor", front)):
            for concurrency in (1, CONCURRENCY):
                engine.runtime.call(arm(concurrency))  # warm
                start = time.perf_counter()
                latencies = engine.runtime.call(arm(concurrency))
                elapsed = time.perf_counter() - start
                out[f"{name}_{concurrency}_calls_per_s"] = n / elapsed
                out[f"{name}_{concurrency}_latency_ms"] = 1e3 * statistics.median(latencies)
    return out


def _episodes(ctx: BenchContext, batches: int) -> dict[str, float]:
    register("bench_three_turns", ThreeTurns, overwrite=True)
    register("bench_three_calls", lambda: AgentEnv(three_calls), overwrite=True)
    episode = EpisodeSettings(
        system_prompt=None,
        max_turns=TURNS,
        sampling={"max_tokens": MAX_TOKENS, "ignore_eos": True},
    )
    out: dict[str, float] = {}
    for name in ("bench_three_turns", "bench_three_calls"):
        config = PipelineConfig(envs=name, episode=episode, group_size=4, batch_size=32)
        with RolloutPipeline(config, ctx.engine, ctx.tokenizer) as pipe:
            pipe.get_batch()  # warm
            start = time.perf_counter()
            n = sum(len(pipe.get_batch()) for _ in range(batches))
            out[name] = n / (time.perf_counter() - start)
    return out


def run(ctx: BenchContext) -> Figures:
    n = ctx.size(smoke=8, quick=128, full=512)
    batches = ctx.size(smoke=1, quick=3, full=6)
    ratios, added, agent = [], [], []
    figures: Figures = {}
    for _ in range(ctx.repeats_for(3)):
        calls = _calls(ctx, n)
        ratios.append(
            calls[f"frontdoor_{CONCURRENCY}_calls_per_s"]
            / calls[f"direct_{CONCURRENCY}_calls_per_s"]
        )
        added.append(calls["frontdoor_1_latency_ms"] - calls["direct_1_latency_ms"])
        episodes = _episodes(ctx, batches)
        agent.append(episodes["bench_three_calls"] / episodes["bench_three_turns"])
        ctx.log(f"  calls ratio {ratios[-1]:.2f}, added {added[-1]:.1f} ms, agent {agent[-1]:.2f}")
        figures.update({k: rounded(v, 2) for k, v in calls.items()})
    figures["frontdoor_calls_ratio"] = rounded(median(ratios), 3)
    figures["frontdoor_added_latency_ms"] = rounded(median(added), 2)
    figures["agent_vs_text_trajectories_ratio"] = rounded(median(agent), 3)
    return figures
