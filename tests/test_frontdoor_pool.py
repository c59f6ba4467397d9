"""The front door over an ``EnginePool``: every call of one agent session reaches one
rank (its prefix stays in that rank's KV cache), and sessions spread over the ranks.

The ranks are ``ScriptedEngine``s (routing is what is tested, not the model) behind a
real ``EnginePool``, the real front door and the real ``openai`` client. The first calls
are held (the pool paused, or the ranks' ``GATE`` closed) until they are all routed and
in flight: the spread is decided by the router's loads, never by timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tool_support import tools_model_path
from waiting import wait_until

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.config import PipelineConfig
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs import register
from rollpipe.frontdoor import AgentEnv, FrontDoor
from rollpipe.pipeline import RolloutPipeline

SETTINGS = EpisodeSettings(max_length=1024, sampling={"max_tokens": 16})
CALLS = 3
GATE = threading.Event()  # the ranks answer while it is set
GATE.set()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tools_model_path()))


@pytest.fixture(scope="module")
def pool(tokenizer: Any) -> Iterator[EnginePool]:
    reply = tokenizer.encode("Sure.", add_special_tokens=False)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def answer(prompt: Any, params: Any) -> list[int]:
        GATE.wait(120)  # open unless a test holds the ranks (their loops wait here)
        return [*reply, eot]

    def make(rank: int) -> ScriptedEngine:
        return ScriptedEngine(answer, name=f"rank-{rank}")

    engines = EnginePool(make, 2)
    yield engines
    engines.close()


def in_flight(pool: EnginePool) -> int:
    return sum(load.requests for load in pool.loads())


async def conversation(client: openai.AsyncOpenAI, first: str) -> None:
    """``CALLS`` calls, each extending the last (one row, the same prefix growing)."""
    messages: list[Any] = [{"role": "user", "content": first}]
    for i in range(CALLS):
        reply = await client.chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": f"And {i}?"}]


def ranks_by_session(pool: EnginePool, start: int) -> dict[Any, list[int]]:
    ranks: defaultdict[Any, list[int]] = defaultdict(list)
    for key, rank in list(pool.routing_log)[start:]:
        ranks[key].append(rank)
    return dict(ranks)


def test_a_sessions_calls_stay_on_one_rank_and_sessions_spread(
    pool: EnginePool, tokenizer: Any
) -> None:
    start = len(pool.routing_log)
    with FrontDoor(pool, tokenizer, SETTINGS) as door:
        sessions = [door.open_session() for _ in range(4)]

        async def agents() -> None:
            clients = [
                openai.AsyncOpenAI(base_url=door.url, api_key=s.key, max_retries=0)
                for s in sessions
            ]
            await asyncio.gather(*(conversation(c, f"Hi {i}") for i, c in enumerate(clients)))
            for c in clients:
                await c.close()

        pool.pause("keep")  # the first calls are routed, then wait: all in flight at once
        runner = threading.Thread(target=asyncio.run, args=(agents(),))
        runner.start()
        try:
            wait_until(lambda: in_flight(pool) == len(sessions), 60, "every first call routed")
        finally:
            pool.resume()
        runner.join(60)
        assert not runner.is_alive()
        trajectories = [door.finish(s.key) for s in sessions]
    ranks = ranks_by_session(pool, start)
    assert set(ranks) == {s.spec.episode_id for s in sessions}
    assert all(len(r) == CALLS and len(set(r)) == 1 for r in ranks.values()), ranks
    assert sorted(r[0] for r in ranks.values()) == [0, 0, 1, 1]  # spread by load
    for traj in trajectories:  # one row per session: its calls extended each other
        assert len(traj.turns) == CALLS and traj.prefix_breaks == 0 and traj.error is None


async def agent(client: openai.AsyncOpenAI, task: str) -> float:
    await conversation(client, task)
    return 1.0


register("frontdoor-pool-agent", lambda: AgentEnv(agent, task=str), overwrite=True)


def test_agent_episodes_of_a_pipeline_stick_to_a_rank_and_spread(
    pool: EnginePool, tokenizer: Any
) -> None:
    config = PipelineConfig(
        envs="frontdoor-pool-agent", episode=SETTINGS, group_size=2, batch_size=4, concurrency=4
    )
    start = len(pool.routing_log)
    batches: list[Any] = []
    with RolloutPipeline(config, pool, tokenizer) as pipe:
        # held at the ranks, not by pausing the pool: get_batch resumes an engine that
        # another pipeline paused, and the zero-latency ranks would then answer each
        # call before the next is routed
        GATE.clear()
        fetch = threading.Thread(target=lambda: batches.append(pipe.get_batch()))
        fetch.start()
        try:
            wait_until(lambda: in_flight(pool) >= 2, 60, "two episodes' first calls routed")
        finally:
            GATE.set()
        fetch.join(60)
        assert not fetch.is_alive() and batches
    batch = batches[0]
    assert set(batch.non_tensor_batch["end_reasons"]) == {"terminated"}
    ranks = ranks_by_session(pool, start)
    assert set(batch.batch["traj_id"].tolist()) <= set(ranks)
    assert all(len(set(r)) == 1 for r in ranks.values()), ranks  # sticky across calls
    assert {r[0] for r in ranks.values()} == {0, 1}  # episodes spread by load
    finished = [r for key, r in ranks.items() if key in set(batch.batch["traj_id"].tolist())]
    assert all(len(r) == CALLS for r in finished)  # one routed request per call
