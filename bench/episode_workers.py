"""Benchmark: the driver's CPU per turn with 0, 1 and 2 episode workers (issue 38).

The engine is a ``ScriptedEngine`` in the driver (every answer instant, a fixed
response), so the driver's CPU is rollpipe's: with 0 workers the whole episode loop, with
workers only admission, routing, the engine call, the mail to and from the workers, group
assembly and collation. Figures are the driver process's CPU time
(``time.process_time``: every thread of the driver, Ray's own included; the workers'
processes not) over ``get_batch`` calls after a first, unmeasured batch (workers started,
envs built), divided by the turns taken:

* ``driver_cpu_us_text_turn_{W}w``: a text turn (``bench.tool_turn.EchoText``);
* ``driver_cpu_us_tool_turn_{W}w``: a tool turn (``EchoTools``: a hermes call parsed,
  run, its result rendered and tokenized);
* ``driver_cpu_us_agent_call_{W}w``: one call of a front-door agent (``AgentEnv``,
  ``CALLS`` calls per episode through the ``openai`` client and the door);
* ``driver_cpu_{kind}_{W}w_over_0w``: the ratio to in-process, side by side in one run.

And the wall rate of many agents at once: ``agent_calls_per_s_{W}w`` for ``AGENTS``
concurrent front-door agents in-process (0) and on 2 workers, and
``agent_calls_per_s_2w_over_0w``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench.common import BenchContext, Figures, median, one_torch_thread, rounded
from bench.tool_turn import CALL, EchoText, EchoTools
from rollpipe.engines.records import SamplingParams
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.frontdoor import AgentEnv
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

EPISODES = 32
TURNS = 8
CALLS = 4
AGENTS = 256
WORKERS = (0, 1, 2)


async def calls_agent(client: Any, task: Any) -> float:
    """``CALLS`` calls, each with the conversation so far."""
    messages: list[Any] = [{"role": "user", "content": "Say something."}]
    for _ in range(CALLS):
        reply = await client.chat.completions.create(model="m", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": "And more."})
    return 1.0


def agent_env(spec: Any) -> AgentEnv:
    return AgentEnv(calls_agent)


def text_env(spec: Any) -> EchoText:
    return EchoText()


def tool_env(spec: Any) -> Any:
    return EchoTools()


def _config(kind: str, workers: int, episodes: int) -> PipelineConfig:
    return PipelineConfig(
        group_size=1,
        num_groups=3 * episodes,
        batch_size=episodes,
        max_turns=TURNS,
        max_length=2**16,
        tool_parser="hermes" if kind == "tool" else None,
        rollout={"concurrency": episodes, "episode_workers": workers},
    )


def _one_run(tokenizer: Any, kind: str, workers: int, episodes: int) -> tuple[float, float]:
    """(driver CPU µs per turn or call, turns or calls per wall second) over two batches."""
    text = CALL if kind == "tool" else "Something to say, and more to say."
    response = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    factory = {"text": text_env, "tool": tool_env, "agent": agent_env}[kind]
    config = _config(kind, workers, episodes).replace(
        sampling=SamplingParams(max_tokens=len(response))
    )
    with (
        ScriptedEngine(lambda prompt, params: response) as engine,
        RolloutPipeline(config, engine, tokenizer, env_factory=factory) as pipe,
    ):
        pipe.get_batch()  # workers up, envs built, caches warm: not measured
        cpu, wall = time.process_time(), time.perf_counter()
        batches = [pipe.get_batch(), pipe.get_batch()]
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    taken = sum(int(b.batch["response_mask"].sum()) for b in batches) // len(response)
    if taken < episodes:
        raise RuntimeError(f"episode_workers: {taken} turns taken by {2 * episodes} episodes")
    return 1e6 * cpu / taken, taken / wall


def run(ctx: BenchContext) -> Figures:
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules["bench.tool_turn"])
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with one_torch_thread():
            return _run(ctx)
    finally:
        if started:
            ray.shutdown()


def _run(ctx: BenchContext) -> Figures:
    from transformers import AutoTokenizer

    from rollpipe.training.tiny_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(tools=True))
    repeats = ctx.repeats_for(3)
    workers = ctx.size(smoke=(0, 1), quick=WORKERS, full=WORKERS)
    episodes = ctx.size(smoke=8, quick=EPISODES, full=EPISODES)
    out: Figures = {}
    for kind, unit in (("text", "turn"), ("tool", "turn"), ("agent", "call")):
        for w in workers:
            runs = [_one_run(tokenizer, kind, w, episodes)[0] for _ in range(repeats)]
            out[f"driver_cpu_us_{kind}_{unit}_{w}w"] = rounded(median(runs), 1)
            ratio = median(runs) / float(out[f"driver_cpu_us_{kind}_{unit}_0w"])
            out[f"driver_cpu_{kind}_{w}w_over_0w"] = rounded(ratio, 2)
        figures = [f"{w}w {out[f'driver_cpu_us_{kind}_{unit}_{w}w']}" for w in workers]
        ctx.log(f"  driver CPU per {kind} {unit} (µs): " + ", ".join(figures))
    agents = ctx.size(smoke=16, quick=AGENTS, full=AGENTS)
    for w in (0, workers[-1]):
        rates = [_one_run(tokenizer, "agent", w, agents)[1] for _ in range(repeats)]
        out[f"agent_calls_per_s_{w}w"] = rounded(median(rates), 1)
    last = workers[-1]
    ratio = float(out[f"agent_calls_per_s_{last}w"]) / float(out["agent_calls_per_s_0w"])
    out[f"agent_calls_per_s_{last}w_over_0w"] = rounded(ratio, 2)
    ctx.log(
        f"  {agents} agents: calls/s 0w {out['agent_calls_per_s_0w']}, {last}w "
        f"{out[f'agent_calls_per_s_{last}w']}"
    )
    return out
