"""The front door on the real vLLM engine with the real ``openai`` client: an agent's
calls become rows whose ids are exactly what the engine received and produced."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tool_support import add, recording, tools_model_path

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.agent.tools import tool_set
from rollpipe.data.rows import step_rows, trajectory_rows
from rollpipe.frontdoor import AgentEnv, AgentResult, FrontDoor

SETTINGS = EpisodeSettings(tool_parser="hermes", max_length=1536, sampling={"max_tokens": 24})
TOOLS = [dict(s) for s in tool_set([add]).schemas]


@pytest.fixture(scope="module")
def engine(tools_vllm_engine: Any) -> Iterator[Any]:
    """The tiny tools model on vLLM, each request and answer recorded at the boundary."""
    with recording(tools_vllm_engine, lambda ids, params, gen: (list(ids), gen)) as e:
        yield e


@pytest.fixture
def chat(engine: Any) -> Any:
    from transformers import AutoTokenizer

    engine.seen.clear()
    return SETTINGS.chat_format(AutoTokenizer.from_pretrained(str(tools_model_path())))


def run(engine: Any, chat: Any, agent: Any, **kw: Any) -> Trajectory:
    env = AgentEnv(agent, task=lambda seed: f"What is {seed} + 3?", **kw)
    try:
        spec = EpisodeSpec(0, 7, 2, "agent")
        return engine.runtime.call(env.run_episode(spec, engine, chat, SETTINGS))  # type: ignore[no-any-return]
    finally:
        env.close()


def answered(messages: list[dict[str, Any]], reply: Any, follow_up: str) -> None:
    """Append the reply as the client echoes it, then tool results or a user turn."""
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "name": "add", "content": "5"})
    if not message.tool_calls:
        messages.append({"role": "user", "content": follow_up})


def assert_one_exact_row(traj: Trajectory, seen: list[tuple[list[int], Any]]) -> None:
    assert len(traj.turns) == len(seen)
    context: list[int] = []
    for turn, (prompt, gen) in zip(traj.turns, seen, strict=True):
        context = [*context, *turn.prompt_ids]
        assert context == prompt  # what the engine received
        assert turn.response_ids == gen.token_ids and turn.logprobs == gen.logprobs
        assert turn.versions == gen.versions
        context = [*context, *turn.response_ids]
    rows = trajectory_rows([traj], pad_token_id=0)
    n = int(rows.batch["attention_mask"].sum())
    assert rows.batch["input_ids"][0, :n].tolist() == context


def test_a_multi_turn_agent_becomes_the_engines_exact_ids(engine: Any, chat: Any) -> None:
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> AgentResult:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        for i in range(4):
            reply = await client.chat.completions.create(
                model="any",
                messages=messages,
                tools=TOOLS,
                logprobs=True,  # type: ignore[arg-type]
                extra_body={"return_token_ids": True},
            )
            replies.append(reply)
            answered(messages, reply, f"Check step {i} again.")
        return AgentResult(0.5, success=True, metrics={"agent/steps": 4.0})

    traj = run(engine, chat, agent)
    assert traj.error is None and traj.end_reason == "terminated" and traj.success
    assert traj.score == 0.5 and [t.reward for t in traj.turns] == [0, 0, 0, 0.5]
    assert traj.env_metrics["prefix_breaks"] == 0.0 and traj.env_metrics["agent/steps"] == 4.0
    assert traj.env_metrics["tool/calls"] == sum(
        len(r.choices[0].message.tool_calls or []) for r in replies
    )
    assert traj.prefix_breaks == 0 and traj.history_window is None
    assert_one_exact_row(traj, engine.seen)
    first = chat.tokenizer.decode(traj.turns[0].prompt_ids)
    assert first.count('"name": "add"') == 1 and "What is 2 + 3?" in first  # tools rendered
    for reply, (prompt, gen) in zip(replies, engine.seen, strict=True):
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.usage.completion_tokens == len(gen.token_ids)
        assert reply.model_extra["prompt_token_ids"] == prompt  # vLLM's return_token_ids
        assert reply.choices[0].model_extra["token_ids"] == list(gen.token_ids)
        assert [c.logprob for c in reply.choices[0].logprobs.content] == list(gen.logprobs)


def test_a_rewritten_history_is_a_break_and_a_second_row(engine: Any, chat: Any) -> None:
    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        answered(
            messages, await client.chat.completions.create(model="m", messages=messages), "Go on."
        )  # type: ignore[arg-type]
        messages = [{"role": "user", "content": "Forget that. What is 1 + 1?"}]  # rewritten
        answered(
            messages, await client.chat.completions.create(model="m", messages=messages), "Sure?"
        )  # type: ignore[arg-type]
        await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        return 1.0

    traj = run(engine, chat, agent)
    assert traj.error is None and len(traj.turns) == 3
    assert [t.prefix_break for t in traj.turns] == [False, True, False]
    assert traj.prefix_breaks == 1 and traj.env_metrics["prefix_breaks"] == 1.0
    assert [t.new_row for t in traj.turns] == [False, True, False]
    rows = step_rows([traj], pad_token_id=0)
    for i, (prompt, gen) in enumerate(engine.seen):
        n = int(rows.batch["attention_mask"][i].sum())
        assert rows.batch["input_ids"][i, :n].tolist() == [*prompt, *gen.token_ids]
    assert engine.seen[2][0][: len(engine.seen[1][0])] == engine.seen[1][0]  # row 2 grew
    whole = trajectory_rows([traj], pad_token_id=0)  # one row per session row
    assert len(whole) == 2 and list(whole.non_tensor_batch["traj_uid"]) == [traj.traj_id] * 2
    (p0, g0), (_, g1), (p2, g2) = ((p, list(g.token_ids)) for p, g in engine.seen)
    for i, ids in enumerate(([*p0, *g0], [*p2, *g2])):  # row 2: the last request and answer
        n = int(whole.batch["attention_mask"][i].sum())
        assert whole.batch["input_ids"][i, :n].tolist() == ids
    generated = whole.batch["response_mask"].sum(dim=1).tolist()
    assert generated == [len(g0), len(g1) + len(g2)]  # row 2 holds both of its answers


def test_a_bad_or_finished_key_gets_401_and_touches_nothing(engine: Any, chat: Any) -> None:
    with FrontDoor(engine, chat, SETTINGS) as door:
        session = door.open_session()
        other = door.open_session()

        async def ask(key: str) -> Any:
            async with openai.AsyncOpenAI(base_url=door.url, api_key=key, max_retries=0) as c:
                hi = [{"role": "user", "content": "hi"}]
                return await c.chat.completions.create(model="m", messages=hi)  # type: ignore[arg-type]

        for key in ("rp-wrong", "Bearer", session.key[:-1]):
            with pytest.raises(openai.AuthenticationError) as caught:
                asyncio.run(ask(key))
            assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        asyncio.run(ask(other.key))
        traj = door.finish(other.key, reward=1.0)
        assert len(traj.turns) == 1 and traj.score == 1.0
        with pytest.raises(openai.AuthenticationError):
            asyncio.run(ask(other.key))  # finished
        assert session.rows == [] and session.calls == 0 and len(engine.seen) == 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot"}]}, "messages[1].role"),
        ({"messages": []}, "messages"),
        ({"temperature": 5}, "temperature"),
        (
            {"tools": [{"type": "function", "function": {"description": "x"}}]},
            "tools[0].function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"chat_template": "{{ 7 * 7 }}"}, "chat_template"),
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": 5000}, "messages"),  # fine alone; with a long prompt over budget
    ],
)
def test_a_malformed_request_gets_400_naming_the_field(
    engine: Any, chat: Any, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if param == "messages" and "max_tokens" in extra:
        body["messages"] = [{"role": "user", "content": "word " * 2000}]
    else:
        body.update(extra)
    with FrontDoor(engine, chat, SETTINGS) as door:
        session = door.open_session()

        async def send() -> Any:
            async with openai.AsyncOpenAI(
                base_url=door.url, api_key=session.key, max_retries=0
            ) as c:
                return await c.post("/chat/completions", body=body, cast_to=object)

        with pytest.raises(openai.BadRequestError) as caught:
            asyncio.run(send())
        assert caught.value.status_code == 400 and caught.value.param == param
        assert param.split("[")[0].split(".")[0] in caught.value.message
        assert session.rows == [] and engine.seen == []


def test_a_body_that_is_not_json_gets_400_and_no_key_401(engine: Any, chat: Any) -> None:
    import aiohttp

    with FrontDoor(engine, chat, SETTINGS) as door:
        session = door.open_session()

        async def send(headers: dict[str, str]) -> tuple[int, Any]:
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    f"{door.url}/chat/completions", data=b"{not json", headers=headers
                ) as response,
            ):
                return response.status, await response.json()

        status, body = asyncio.run(send({"Authorization": f"Bearer {session.key}"}))
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = asyncio.run(send({}))
        assert status == 401 and body["error"]["type"] == "authentication_error"


def test_an_agent_that_raises_is_an_errored_episode(engine: Any, chat: Any) -> None:
    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": task}]
        )
        raise ZeroDivisionError("the agent's own bug")

    traj = run(engine, chat, agent)
    assert traj.end_reason == "error" and traj.error_type == "ZeroDivisionError"
    assert "the agent's own bug" in (traj.error or "") and traj.error_call == "agent"
    assert len(traj.turns) == 1  # the call it made is kept


def test_an_agent_returning_no_reward_is_an_errored_episode(engine: Any, chat: Any) -> None:
    async def agent(client: openai.AsyncOpenAI, task: str) -> Any:
        return "five"

    traj = run(engine, chat, agent)
    assert traj.end_reason == "error" and traj.error_type == "TypeError"
    assert "AgentResult" in (traj.error or "")


def test_an_agent_that_never_returns_times_out(engine: Any, chat: Any) -> None:
    keys: list[str] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        keys.append(client.api_key)
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": task}]
        )
        await asyncio.Event().wait()  # work that cannot finish
        return 1.0

    env = AgentEnv(agent, task=str, timeout_s=1.0)
    try:
        traj = engine.runtime.call(env.run_episode(EpisodeSpec(0, 0, 0), engine, chat, SETTINGS))
        assert traj.end_reason == "error" and traj.error_type == "AgentTimeoutError"
        assert len(traj.turns) == 1
        assert env.door is not None and keys[0] not in env.door.sessions  # finished
    finally:
        env.close()


def test_messages_dumped_by_the_client_compare_as_sent(engine: Any, chat: Any) -> None:
    """An assistant message echoed as the client's model (content None, refusal, ...)
    extends the conversation; JSON arguments as an object too."""

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": task}]}]
        reply = await client.chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "More."}]
        await client.chat.completions.create(model="m", messages=messages)
        return 0.0

    traj = run(engine, chat, agent)
    assert traj.error is None and traj.prefix_breaks == 0
    assert_one_exact_row(traj, engine.seen)
    assert json.loads(json.dumps(traj.to_state()["env_metrics"]))["prefix_breaks"] == 0.0


def test_a_session_open_past_its_limit_ends_as_errored(engine: Any, chat: Any) -> None:
    from waiting import wait_until

    with FrontDoor(engine, chat, SETTINGS) as door:
        session = door.open_session(timeout_s=0.5)
        wait_until(lambda: session.key not in door.sessions, 30, "the session's time limit")

        async def ask() -> Any:
            async with openai.AsyncOpenAI(base_url=door.url, api_key=session.key) as c:
                hi = [{"role": "user", "content": "hi"}]
                return await c.chat.completions.create(model="m", messages=hi)  # type: ignore[arg-type]

        with pytest.raises(openai.AuthenticationError):
            asyncio.run(ask())
        traj = door.finish(session.key, reward=1.0)
        assert traj.end_reason == "error" and traj.error_type == "SessionTimeoutError"
        assert traj.error_call == "session" and engine.seen == []


AGENT_PROCESS = """
import openai  # configured by OPENAI_BASE_URL and OPENAI_API_KEY alone
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": "What is 2 + 3?"}]
reply = client.chat.completions.create(model="m", messages=messages)
messages.append(reply.choices[0].message.model_dump(exclude_none=True))
messages.append({"role": "user", "content": "Sure?"})
client.chat.completions.create(model="m", messages=messages)
"""


def test_an_agent_in_another_process_is_collected(engine: Any, chat: Any) -> None:
    import os
    import subprocess
    import sys

    with FrontDoor(engine, chat, SETTINGS) as door:
        session = door.open_session()
        env = {**os.environ, "OPENAI_BASE_URL": door.url, "OPENAI_API_KEY": session.key}
        done = subprocess.run(
            [sys.executable, "-c", AGENT_PROCESS], env=env, capture_output=True, timeout=300
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        traj = door.finish(session.key, reward=1.0)
    assert traj.error is None and traj.prefix_breaks == 0
    assert_one_exact_row(traj, engine.seen)


def test_the_agent_envs_of_a_pipeline_share_one_door(engine: Any, chat: Any) -> None:
    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        hi = [{"role": "user", "content": task}]
        await client.chat.completions.create(model="m", messages=hi)  # type: ignore[arg-type]
        return 1.0

    first, second = AgentEnv(agent, task=str), AgentEnv(agent, task=str)
    spec = EpisodeSpec(0, 0, 0)
    for env in (first, second):
        assert engine.runtime.call(env.run_episode(spec, engine, chat, SETTINGS)).error is None
    door = first.door
    assert door is not None and second.door is door
    first.close()
    assert not door.closed
    assert engine.runtime.call(second.run_episode(spec, engine, chat, SETTINGS)).error is None
    second.close()
    assert door.closed
