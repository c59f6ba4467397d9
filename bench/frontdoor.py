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

Streaming, on the same engine at concurrency 1, ``STREAM_TOKENS`` tokens a call:

* ``stream_first_chunk_ms``: median time from sending a ``stream=true`` call to its
  first content chunk; ``stream_whole_ms`` the same call to its last chunk, and
  ``unstreamed_ms`` the same call without ``stream`` (side by side).
  ``stream_first_over_unstreamed``: how much sooner an agent sees text when it streams.

With a zero-latency ``ScriptedEngine`` (the engine costs nothing, so only the front door
is measured; issue 28's per-request cost):

* ``frontdoor_rollpipe_us_per_call_{8,128}``: rollpipe's own CPU per call (thread time)
  of a conversation of 8 or 128 calls at its last calls: the request's JSON, its checks,
  the prompt (render diff), recording, the answer's JSON; no HTTP, no client.
  ``frontdoor_rollpipe_128_over_8``: their ratio (1.0: the cost does not grow).
* ``zero_latency_{direct,frontdoor}_calls_per_s`` and ``zero_latency_calls_ratio``: calls
  per second through the front door (HTTP, the ``openai`` client on the same loop) ÷
  ``await engine.generate`` at ``CONCURRENCY`` callers, side by side in one run.
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
STREAM_TOKENS = 64
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
            http = openai.DefaultAsyncHttpxClient(verify=False)  # as AgentEnv's clients:
            clients = [  # no TLS CA bundle loaded per client (~20 ms each) for plain http
                openai.AsyncOpenAI(base_url=door.url, api_key=k, max_retries=0, http_client=http)
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
            await http.aclose()
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


def _streaming(ctx: BenchContext, n: int) -> dict[str, float]:
    import openai

    settings = EpisodeSettings(system_prompt=None, sampling={"max_tokens": STREAM_TOKENS})
    messages = [{"role": "user", "content": QUESTION}]
    times: dict[str, list[float]] = {"first": [], "whole": [], "unstreamed": []}
    with FrontDoor(ctx.engine, settings.chat_format(ctx.tokenizer), settings) as door:
        key = door.open_session().key

        async def calls() -> None:
            async with openai.AsyncOpenAI(base_url=door.url, api_key=key, max_retries=0) as c:
                ask = {"model": "m", "messages": messages, "extra_body": {"ignore_eos": True}}
                for _ in range(n):
                    start = time.perf_counter()
                    stream = await c.chat.completions.create(stream=True, **ask)
                    first = None
                    async for chunk in stream:
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter() - start
                    times["whole"].append(time.perf_counter() - start)
                    times["first"].append(first if first is not None else times["whole"][-1])
                    start = time.perf_counter()
                    await c.chat.completions.create(**ask)
                    times["unstreamed"].append(time.perf_counter() - start)

        ctx.engine.runtime.call(calls())
    out = {f"stream_{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}
    out["unstreamed_ms"] = out.pop("stream_unstreamed_ms")
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


def _scripted(ctx: BenchContext) -> Any:
    from rollpipe.engines.scripted import ScriptedEngine

    reply = ctx.tokenizer.encode("Sure, the answer is 5.", add_special_tokens=False)
    eot = ctx.tokenizer.eos_token_id if ctx.tokenizer.eos_token_id is not None else 0
    return ScriptedEngine(lambda prompt, params: [*reply, eot])


def _rollpipe_cost(ctx: BenchContext, turns: int) -> float:
    """rollpipe's CPU µs per call at the last 4 calls of a ``turns``-call conversation."""
    import json

    from rollpipe.agent.records import EpisodeSpec
    from rollpipe.engines.records import Generation
    from rollpipe.frontdoor.requests import parse_chat_request
    from rollpipe.frontdoor.responses import completion_body
    from rollpipe.frontdoor.session import AgentSession, Call

    chat = EpisodeSettings(system_prompt=None, max_length=1 << 20).chat_format(ctx.tokenizer)
    ids = ctx.tokenizer.encode("Sure, the answer is 5.", add_special_tokens=False)
    gen = Generation(ids, [-0.5] * len(ids), "length", [0] * len(ids))
    session = AgentSession("key", EpisodeSpec(0, 0, 0, "agent"), chat)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    spent: list[float] = []
    for i in range(turns):
        raw = json.dumps({"model": "m", "messages": messages}).encode()
        start = time.thread_time()
        request = parse_chat_request(json.loads(raw), session.last_request)
        session.last_request = request
        prompt = session.prompt_for(request)
        paused = time.thread_time()  # the door's sampling: not counted, as before the Call
        call = Call(request, prompt, session.sampling(request, 1 << 19, None))
        start += time.thread_time() - paused
        text = chat.decode_for_parsing(list(gen.token_ids))
        action, message = session.record(call, gen, text)
        body = completion_body(
            completion_id="c",
            model="m",
            message=message,
            action=action,
            gen=gen,
            prompt_tokens=len(prompt.ids),
            tokenizer=ctx.tokenizer,
            logprobs=False,
        )
        answer = json.dumps(body).encode()
        spent.append(time.thread_time() - start)
        echoed = json.loads(answer)["choices"][0]["message"]
        messages = [*messages, echoed, {"role": "user", "content": f"Go on ({i})."}]
    return 1e6 * statistics.mean(spent[-4:])


def _zero_latency(ctx: BenchContext, n: int) -> dict[str, float]:
    """Front door ÷ direct calls/s at ``CONCURRENCY`` callers on a zero-latency engine."""
    import openai

    settings = EpisodeSettings(system_prompt=None, sampling={"max_tokens": MAX_TOKENS})
    messages = [{"role": "user", "content": QUESTION}]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    out: dict[str, float] = {}
    with _scripted(ctx) as engine, FrontDoor(engine, ctx.tokenizer, settings) as door:
        prompt = door.chat.encode(door.chat.render_messages(messages, generation_prompt=True))
        keys = [door.open_session().key for _ in range(CONCURRENCY)]

        async def direct() -> None:
            left = list(range(n))

            async def worker() -> None:
                while left:
                    left.pop()
                    await engine.generate(prompt, params)

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

        async def front() -> None:
            left = list(range(n))
            http = openai.DefaultAsyncHttpxClient(verify=False)  # as AgentEnv's client
            clients = [
                openai.AsyncOpenAI(base_url=door.url, api_key=k, max_retries=0, http_client=http)
                for k in keys
            ]

            async def worker(client: Any) -> None:
                while left:
                    left.pop()
                    await client.chat.completions.create(model="m", messages=messages)

            await asyncio.gather(*(worker(c) for c in clients))
            await http.aclose()

        for name, arm in (("direct", direct), ("frontdoor", front)):
            engine.runtime.call(arm())  # warm
            start = time.perf_counter()
            engine.runtime.call(arm())
            out[f"zero_latency_{name}_calls_per_s"] = n / (time.perf_counter() - start)
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
    costs: dict[int, list[float]] = {8: [], 128: []}
    zero: list[dict[str, float]] = []
    long_turns = ctx.size(smoke=16, quick=128, full=128)
    for _ in range(ctx.repeats_for(3)):
        costs[8].append(_rollpipe_cost(ctx, 8))
        costs[128].append(_rollpipe_cost(ctx, long_turns))
        zero.append(_zero_latency(ctx, n))
    for turns, values in costs.items():
        figures[f"frontdoor_rollpipe_us_per_call_{turns}"] = rounded(median(values), 1)
    figures["frontdoor_rollpipe_128_over_8"] = rounded(median(costs[128]) / median(costs[8]), 3)
    for key in zero[0]:
        figures[key] = rounded(median([z[key] for z in zero]), 1)
    figures["zero_latency_calls_ratio"] = rounded(
        median(
            [
                z["zero_latency_frontdoor_calls_per_s"] / z["zero_latency_direct_calls_per_s"]
                for z in zero
            ]
        ),
        4,
    )
    ctx.log(
        f"  rollpipe {figures['frontdoor_rollpipe_us_per_call_8']} us/call at 8 calls, "
        f"{figures['frontdoor_rollpipe_us_per_call_128']} at 128; zero-latency calls/s "
        f"{figures['zero_latency_frontdoor_calls_per_s']} front door vs "
        f"{figures['zero_latency_direct_calls_per_s']} direct "
        f"({figures['zero_latency_calls_ratio']}x)"
    )
    streams = [
        _streaming(ctx, ctx.size(smoke=2, quick=16, full=48)) for _ in range(ctx.repeats_for(3))
    ]
    for key in streams[0]:
        figures[key] = rounded(median([st[key] for st in streams]), 2)
    figures["stream_first_over_unstreamed"] = rounded(
        median([st["stream_first_ms"] / st["unstreamed_ms"] for st in streams]), 3
    )
    ctx.log(
        f"  streamed: first chunk {figures['stream_first_ms']} ms, whole "
        f"{figures['stream_whole_ms']} ms; unstreamed {figures['unstreamed_ms']} ms"
    )
    figures["frontdoor_calls_ratio"] = rounded(median(ratios), 3)
    figures["frontdoor_added_latency_ms"] = rounded(median(added), 2)
    figures["agent_vs_text_trajectories_ratio"] = rounded(median(agent), 3)
    return figures
