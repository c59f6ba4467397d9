"""One row per trajectory for the usual ``openai``-client agent: its last "answer" call
leaves ``tools`` out, and with ``keep_tools`` (the default) that call continues the row
instead of starting a second one. Real vLLM engine, real ``openai.AsyncOpenAI`` client
through the front door, real pipeline; a render that truly differs still splits and is
counted in ``prefix_breaks``."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tool_support import add, recording, tools_model_path

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.tools import tool_set
from rollpipe.config import PipelineConfig
from rollpipe.envs import register
from rollpipe.frontdoor import AgentEnv
from rollpipe.pipeline import RolloutPipeline


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


TOOLS = [dict(s) for s in tool_set([add]).schemas]
OTHER_TOOLS = [dict(s) for s in tool_set([mul]).schemas]
EPISODE = EpisodeSettings(tool_parser="hermes", max_length=1024, sampling={"max_tokens": 12})
BATCH = 4


def answering_agent(last_tools: list[dict[str, Any]] | None) -> Any:
    """An agent that works with ``TOOLS``, then asks for its answer with ``last_tools``
    (None: the call leaves ``tools`` out, as most agents do)."""

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        messages.append(reply.choices[0].message)
        for c in reply.choices[0].message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": c.id, "name": "add", "content": "5"})
        messages.append({"role": "user", "content": "Now answer."})
        extra = {} if last_tools is None else {"tools": last_tools}
        answer = await client.chat.completions.create(model="m", messages=messages, **extra)
        return float(len(answer.choices[0].message.content or "") % 2)

    return agent


def env_name(last: str, keep_tools: bool) -> str:
    """A registered agent env: its last call sends no tools / the same / other tools."""
    name = f"rows-agent-{last}-{keep_tools}"
    tools = {"none": None, "same": TOOLS, "other": OTHER_TOOLS}[last]
    agent = answering_agent(tools)
    register(name, lambda: AgentEnv(agent, task=lambda s: f"{s % 9} + 5?", keep_tools=keep_tools))
    return name


@pytest.fixture(scope="module")
def engine(tools_vllm_engine: Any) -> Iterator[Any]:
    """The tiny tools model on vLLM, every request's prompt and answer recorded."""
    with recording(
        tools_vllm_engine, lambda ids, params, gen: (tuple(ids), tuple(gen.token_ids))
    ) as e:
        yield e


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tools_model_path()))


def one_batch(engine: Any, envs: str) -> Any:
    engine.seen.clear()
    config = PipelineConfig(envs=envs, episode=EPISODE, group_size=2, batch_size=BATCH, seed=5)
    with RolloutPipeline(config, engine, tools_model_path()) as pipe:
        return pipe.get_batch()


def rows(batch: Any) -> list[tuple[int, ...]]:
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    return [tuple(ids[i][mask[i]].tolist()) for i in range(len(batch))]


def calls(engine: Any) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The first and the answer calls the engine got, each as prompt + response ids."""
    decode = tokenizer().decode
    seen = [(prompt + answer, "Now answer." in decode(prompt)) for prompt, answer in engine.seen]
    return [ids for ids, last in seen if not last], [ids for ids, last in seen if last]


def test_an_answer_call_without_tools_continues_the_row(engine: Any) -> None:
    batch = one_batch(engine, env_name("none", keep_tools=True))
    assert len(batch) == BATCH  # one row per trajectory
    assert len(set(batch.batch["traj_id"].tolist())) == BATCH
    assert batch.meta_info["metrics"]["prefix_breaks"] == 0.0
    firsts, answers = calls(engine)
    assert len(firsts) == len(answers) == BATCH
    for row in rows(batch):  # the answer call, whose prompt continues the first call
        assert row in answers
        assert any(row[: len(first)] == first for first in firsts)
        assert "Add two integers" in tokenizer().decode(row)  # the tools block kept


def test_without_keep_tools_the_answer_call_starts_a_second_row(engine: Any) -> None:
    """What a user hit: the template renders the tools into the prompt, so the render
    without them differs and every trajectory gave two rows."""
    batch = one_batch(engine, env_name("none", keep_tools=False))
    assert len(batch) == 2 * BATCH
    assert batch.meta_info["metrics"]["prefix_breaks"] == float(BATCH)
    assert len(set(batch.batch["traj_id"].tolist())) == BATCH


def test_other_tools_still_split_and_are_counted(engine: Any) -> None:
    batch = one_batch(engine, env_name("other", keep_tools=True))
    assert len(batch) == 2 * BATCH  # the engine never saw the two calls as one sequence
    assert batch.meta_info["metrics"]["prefix_breaks"] == float(BATCH)
    firsts, answers = calls(engine)
    assert sorted(rows(batch)) == sorted(firsts + answers)
    texts = [tokenizer().decode(row) for row in rows(batch)]
    assert sum("Multiply two integers" in t for t in texts) == BATCH


def test_the_same_tools_sent_again_continue_the_row(engine: Any) -> None:
    batch = one_batch(engine, env_name("same", keep_tools=True))
    assert len(batch) == BATCH
    assert batch.meta_info["metrics"]["prefix_breaks"] == 0.0
