"""verifiers episodes/s through ``VerifiersEnv`` vs verifiers' own runner, same endpoint.

Not part of ``bench.run`` (it needs the ``verifiers`` extra)::

    PYTHONPATH=$PWD/tests/ecosystems python -m bench.verifiers_cost [taskset] [episodes]

Both sides play the test tasksets (``tests/ecosystems/vf_*.py``) with a scripted model
on a ``ScriptedEngine`` behind a rollpipe ``FrontDoor``, ``CONCURRENCY`` episodes at a
time, so what is compared is the env side: verifiers alone is its eval runner's loop
(``env.serving()`` once, ``run_episode`` per task, one front-door session each, as
``vf-eval`` runs); the adapter is a ``RolloutPipeline`` over ``VerifiersEnv`` (rows,
groups and the batch included). Times include each side's start-up.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import sys
import time
from typing import Any

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.frontdoor import FrontDoor
from rollpipe.pipeline import PipelineConfig, RolloutPipeline
from rollpipe.training.tiny_model import default_model_path

CONCURRENCY = 4
VF = os.environ.get("VF_ADAPTER", "rollpipe.envs.adapters.verifiers:VerifiersEnv")
"""The adapter measured (``$VF_ADAPTER``: another version of it, to compare)."""


def player(prompt: str) -> str:
    """Right answers for vf_add, vf_tools (one calc_add call) and vf_guess (bisection)."""
    results = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    if results:
        return f"The answer is {results[-1]}"
    if m := re.search(r"what is (\d+) \+ 7\?", prompt):
        call = {"name": "calc_add", "arguments": {"a": int(m.group(1)), "b": 7}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    if m := re.search(r"What is (\d+) \+ (\d+)\?", prompt):
        return f"It is {int(m.group(1)) + int(m.group(2))}"
    low, high = 1, 8
    for guess, hint in re.findall(r"(\d+)<\|im_end\|>\n<\|im_start\|>user\n(\w+)", prompt):
        low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
    return str((low + high) // 2)


def scripted_engine(tokenizer: Any) -> ScriptedEngine:
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def policy(prompt: Any, params: Any) -> list[int]:
        text = player(tokenizer.decode(list(prompt)))
        return [*tokenizer.encode(text, add_special_tokens=False), eot]

    return ScriptedEngine(policy)


async def verifiers_alone(door: FrontDoor, taskset: str, n: int) -> float:
    """Episodes/s of verifiers' own loop: serving once, ``run_episode`` per task."""
    import verifiers.v1 as vf
    from verifiers.v1.clients import EvalClientConfig, ModelContext

    from rollpipe.envs.adapters.verifiers import VerifiersEnv

    start = time.perf_counter()
    env = VerifiersEnv(taskset).vf_env  # the same local harness the adapter uses
    tasks = list(env.taskset)
    del vf
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> bool:
        async with limit:
            session = door.open_session()
            os.environ[var := f"VF_COST_KEY_{i}"] = session.key
            ctx = ModelContext(
                model="m", client=EvalClientConfig(base_url=door.url, api_key_var=var)
            )
            episode = await env.run_episode(tasks[i % len(tasks)], ctx)
            door.engine.runtime.call_soon(door.finish, session.key)
            return bool(episode.ok) and sum(t.reward or 0 for t in episode.traces) > 0

    async with env.serving():
        won = await asyncio.gather(*(one(i) for i in range(n)))
    assert all(won), won
    return n / (time.perf_counter() - start)


def through_adapter(engine: Any, tokenizer: Any, taskset: str, n: int) -> float:
    start = time.perf_counter()
    config = PipelineConfig(
        envs=[{"name": VF, "config": {"taskset": taskset}, "tag": "vf"}],
        group_size=2,
        batch_size=n,
        num_groups=n // 2,
        concurrency=CONCURRENCY,
        tool_parser="hermes",
        max_length=4096,
    )
    with RolloutPipeline(config, engine, tokenizer) as pipe:
        batch = pipe.get_batch()
    assert batch.batch["episode_scores"].tolist() == [1.0] * n
    return n / (time.perf_counter() - start)


def main() -> None:
    from transformers import AutoTokenizer

    taskset = sys.argv[1] if len(sys.argv) > 1 else "vf_add"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path(tools=True)))
    importlib.import_module("verifiers.v1")  # paid before either side is timed
    with scripted_engine(tokenizer) as engine:
        adapter = through_adapter(engine, tokenizer, taskset, n)
        print(f"through the adapter: {adapter:.2f} episodes/s", flush=True)
        settings = EpisodeSettings(tool_parser="hermes", max_length=4096)
        with FrontDoor(engine, tokenizer, settings) as door:
            alone = asyncio.run(verifiers_alone(door, taskset, n))
    print(
        f"{taskset}: {n} episodes, {CONCURRENCY} at a time: verifiers alone "
        f"{alone:.2f} episodes/s, through the adapter {adapter:.2f} episodes/s"
    )


if __name__ == "__main__":
    main()
