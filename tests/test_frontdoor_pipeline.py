"""Agent episodes through the whole pipeline on the real vLLM engine: groups and batches
work unchanged, each row is exactly one engine request's ids, and a suspend while agents
are mid-call loses and duplicates nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tool_support import add, tools_model_path
from waiting import wait_until

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.tools import tool_set
from rollpipe.config import PipelineConfig
from rollpipe.envs import register
from rollpipe.frontdoor import AgentEnv
from rollpipe.pipeline import RolloutPipeline

TOOLS = [dict(s) for s in tool_set([add]).schemas]
EPISODE = EpisodeSettings(tool_parser="hermes", max_length=1024, sampling={"max_tokens": 16})


async def agent(client: openai.AsyncOpenAI, task: str) -> float:
    """Three calls, each answering the last; the reward is the length of the last reply."""
    messages: list[Any] = [{"role": "user", "content": task}]
    reply = None
    for i in range(3):
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        for c in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": c.id, "name": "add", "content": "5"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": f"And then {i}?"})
    assert reply is not None
    return float(len(reply.choices[0].message.content or "") % 3)


def task(seed: int) -> str:
    return f"What is {seed % 50} + 3?"


def make_agent_env() -> AgentEnv:
    return AgentEnv(agent, task=task)


register("frontdoor-test-agent", make_agent_env, overwrite=True)


@pytest.fixture(scope="module")
def engine(tools_vllm_engine: Any) -> Iterator[Any]:
    """The tiny tools model on vLLM; every request, its answer and the requests in
    flight recorded at the engine boundary."""
    e = tools_vllm_engine
    generate = e.generate
    e.seen, e.in_flight = [], [0]

    async def recorded(prompt_ids: Any, params: Any, **kw: Any) -> Any:
        e.in_flight[0] += 1
        try:
            gen = await generate(prompt_ids, params, **kw)
        finally:
            e.in_flight[0] -= 1
        e.seen.append((tuple(prompt_ids), gen))
        return gen

    e.generate = recorded
    try:
        yield e
    finally:
        del e.generate, e.seen, e.in_flight  # the shared engine's own method again


def config(**kw: Any) -> PipelineConfig:
    settings = {"envs": "frontdoor-test-agent", "episode": EPISODE, "group_size": 2}
    return PipelineConfig(**(settings | {"batch_size": 4} | kw))


def assert_rows_are_engine_requests(batch: Any, engine: Any) -> None:
    """Each row is one finished request's prompt + response; no trajectory twice."""
    answered = {
        (*prompt, *gen.token_ids) for prompt, gen in engine.seen if gen.finish_reason != "abort"
    }
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    for i in range(len(batch)):
        row = tuple(ids[i, : int(mask[i].sum())].tolist())
        assert row in answered
    traj_ids = batch.batch["traj_id"].tolist()
    assert len(set(traj_ids)) == len(traj_ids)


def test_agent_episodes_make_batches(engine: Any) -> None:
    engine.seen.clear()
    with RolloutPipeline(config(), engine, tools_model_path()) as pipe:
        batch = pipe.get_batch()
    assert len(batch) == 4
    assert set(batch.non_tensor_batch["end_reasons"]) == {"terminated"}
    uids = list(batch.non_tensor_batch["uid"])
    assert len(set(uids)) == 2 and all(uids.count(u) == 2 for u in uids)  # two groups
    assert_rows_are_engine_requests(batch, engine)


def test_a_suspend_while_agents_are_mid_call_loses_nothing(engine: Any) -> None:
    engine.seen.clear()
    with RolloutPipeline(config(), engine, tools_model_path()) as pipe:
        batches: list[Any] = []
        fetch = threading.Thread(target=lambda: batches.append(pipe.get_batch()))
        fetch.start()
        wait_until(lambda: engine.in_flight[0] > 0 and len(engine.seen) >= 2, 60, "agents mid-call")
        pipe.suspend("abort")
        assert engine.is_paused
        pipe.resume()
        fetch.join(120)
        assert not fetch.is_alive() and batches and len(batches[0]) == 4
    assert set(batches[0].non_tensor_batch["end_reasons"]) == {"terminated"}
    assert_rows_are_engine_requests(batches[0], engine)


def test_a_dataset_row_is_the_agents_task(engine: Any) -> None:
    tasks: list[Any] = []

    async def echo(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
        tasks.append(row)
        hi = [{"role": "user", "content": row["question"]}]
        await client.chat.completions.create(model="m", messages=hi)  # type: ignore[arg-type]
        return 1.0

    register("frontdoor-test-rows", lambda: AgentEnv(echo), overwrite=True)
    rows = [{"question": f"What is {i} + 1?"} for i in range(3)]
    cfg = PipelineConfig(
        envs="frontdoor-test-rows",
        dataset={"rows": rows},
        episode=EPISODE,
        group_size=2,
        batch_size=4,
    )
    with RolloutPipeline(cfg, engine, tools_model_path()) as pipe:
        batch = pipe.get_batch()
    assert len(batch) == 4 and set(batch.non_tensor_batch["end_reasons"]) == {"terminated"}
    assert all(t in rows for t in tasks)
    indices = batch.non_tensor_batch["row_index"].tolist()
    assert set(indices) <= {0, 1, 2} and all(indices.count(i) == 2 for i in indices)


def rows_of(batch: Any) -> list[tuple[Any, ...]]:
    """Per row: trajectory uid, its real ids and its score: what equal runs share."""
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    uids, scores = batch.non_tensor_batch["traj_uid"], batch.batch["episode_scores"]
    return [(uids[i], tuple(ids[i][mask[i]].tolist()), float(scores[i])) for i in range(len(batch))]


class Hold:
    """Holds the agents started after the first ``free`` after their first call, until
    released: a checkpoint then finds them mid-episode, whatever the machine's speed."""

    def __init__(self, free: int | None = None) -> None:
        self.free, self.started, self.held = free, 0, 0
        self.release = threading.Event()

    async def agent(self, client: openai.AsyncOpenAI, task: str) -> float:
        self.started += 1
        if self.free is None or self.started <= self.free:
            return await agent(client, task)
        messages: list[Any] = [{"role": "user", "content": task}]
        await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        self.held += 1
        await asyncio.to_thread(self.release.wait)
        return await agent(client, task)  # the same calls and seeds as an episode unheld


def test_a_checkpoint_with_agents_in_flight_resumes_exactly(engine: Any) -> None:
    hold = Hold()
    register("frontdoor-test-held", lambda: AgentEnv(hold.agent, task=task), overwrite=True)
    cfg = config(envs="frontdoor-test-held", num_groups=6, async_generation_ratio=1, concurrency=4)
    with RolloutPipeline(cfg, engine, tools_model_path()) as pipe:
        uninterrupted = [rows_of(b) for b in pipe]
    assert len(uninterrupted) == 3
    hold = Hold(free=4)  # the first batch's two groups run free, the next ones are held
    try:
        with RolloutPipeline(cfg, engine, tools_model_path()) as pipe:
            first = rows_of(pipe.get_batch())
            wait_until(lambda: hold.held > 0, 60, "agents held mid-episode")
            state = plain_round_trip(pipe.state_dict())
    finally:
        hold.release.set()
    assert hold.held > 0
    hold = Hold()
    with RolloutPipeline(cfg, engine, tools_model_path()) as restored:
        restored.load_state_dict(state)
        rest = [rows_of(b) for b in restored]
    assert [first, *rest] == uninterrupted  # nothing lost, nothing twice, the same rows
    uids = [row[0] for batch in (first, *rest) for row in batch]
    assert len(uids) == len(set(uids)) == 12


def plain_round_trip(state: Any) -> Any:
    """``state`` through ``torch.save`` / ``torch.load(weights_only=True)``."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_an_agent_env_is_an_episode_kind_not_an_env() -> None:
    """AgentEnv runs its own episode: it satisfies EpisodeKind, has no reset/step for an
    episode to call by mistake, and a dataset's rows reach it through the spec."""
    from rollpipe.agent.env_contract import EpisodeKind, TextEnv, runs_own_episode
    from rollpipe.envs.registry import takes_row

    async def agent(client: Any, task: Any) -> float:
        return 0.0

    env = AgentEnv(agent, task=lambda seed: "hi")
    assert isinstance(env, EpisodeKind) and runs_own_episode(env)
    assert not isinstance(env, TextEnv) and not hasattr(env, "reset")
    assert takes_row(env)
