"""The front door with scripted model text (the tools model's real tokenizer, template and
hermes parser, the real ``openai`` client and server): tool calls reach the agent parsed,
and an agent conversation that only appends gives rows equal to one fresh render."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tool_support import ScriptedEngine, add, call, tools_model_path

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.agent.tools import tool_set
from rollpipe.frontdoor import AgentEnv, AgentResult
from rollpipe.runtime import Runtime

EOT = "<|im_end|>"
SETTINGS = EpisodeSettings(tool_parser="hermes", max_length=8192, sampling={"max_tokens": 200})
TOOLS = [dict(s) for s in tool_set([add]).schemas]


class LoopEngine(ScriptedEngine):
    """The scripted engine on a runtime of its own, as the front door needs."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, [])
        self.runtime = Runtime("scripted-engine")

    def script(self, texts: list[str]) -> None:
        self.texts, self.prompts, self.responses = list(texts), [], []


@pytest.fixture(scope="module")
def engine() -> Iterator[LoopEngine]:
    from transformers import AutoTokenizer

    e = LoopEngine(AutoTokenizer.from_pretrained(str(tools_model_path())))
    yield e
    e.runtime.close()


@pytest.fixture(scope="module")
def env() -> Iterator[AgentEnv]:
    sent: list[list[dict[str, Any]]] = []

    async def agent(client: openai.AsyncOpenAI, plan: list[str]) -> AgentResult:
        """Sends each step of ``plan``: a user message, or answers the model's calls."""
        messages: list[dict[str, Any]] = []
        sent.clear()
        for i, step in enumerate(plan):
            if step == "tools":
                calls = messages[-1].get("tool_calls") or []
                for c in calls:
                    args = json.loads(c["function"]["arguments"])
                    result = {"role": "tool", "tool_call_id": c["id"], "name": "add"}
                    messages.append({**result, "content": str(args["a"] + args["b"])})
                if not calls:
                    messages.append({"role": "user", "content": f"no call at {i}"})
            else:
                messages.append({"role": "user", "content": step})
            sent.append([dict(m) for m in messages])
            reply = await client.chat.completions.create(
                model="m",
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
            )
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        return AgentResult(1.0, success=True)

    agent_env = AgentEnv(agent, task=lambda seed: [])
    agent_env.sent = sent  # type: ignore[attr-defined]
    yield agent_env
    agent_env.close()


def run(engine: LoopEngine, env: AgentEnv, plan: list[str], texts: list[str]) -> Trajectory:
    engine.script(texts)
    env.task = lambda seed: plan
    chat = SETTINGS.chat_format(engine.tokenizer)
    spec = EpisodeSpec(0, 0, 0, "agent")
    traj = engine.runtime.call(env.run_episode(spec, engine, chat, SETTINGS))
    assert traj.error is None, traj.error
    return traj  # type: ignore[no-any-return]


def test_tool_calls_reach_the_agent_parsed(engine: LoopEngine) -> None:
    seen: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        seen.append(reply)
        message = reply.choices[0].message
        messages.append(message)
        for c in message.tool_calls or []:
            args = json.loads(c.function.arguments)  # type: ignore[union-attr]
            result = str(add(**args))
            messages.append(
                {"role": "tool", "tool_call_id": c.id, "name": "add", "content": result}
            )
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        seen.append(reply)
        return float("5" in (reply.choices[0].message.content or ""))

    engine.script([call("add", a=2, b=3) + EOT, "It is 5." + EOT])
    chat = SETTINGS.chat_format(engine.tokenizer)
    env = AgentEnv(agent, task=lambda seed: "What is 2 + 3?")
    try:
        traj = engine.runtime.call(env.run_episode(EpisodeSpec(0, 0, 0), engine, chat, SETTINGS))
    finally:
        env.close()
    first, second = seen
    assert first.choices[0].finish_reason == "tool_calls"
    (tool_call,) = first.choices[0].message.tool_calls
    assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments) == {
        "a": 2,
        "b": 3,
    }
    assert (
        second.choices[0].message.content == "It is 5."
        and second.choices[0].finish_reason == "stop"
    )
    assert traj.error is None and traj.score == 1.0 and traj.prefix_breaks == 0
    assert [t.action_valid for t in traj.turns] == [True, True]
    assert traj.turns[1].observation == "[tool add] 5"
    assert traj.env_metrics["tool/calls"] == 1 and traj.env_metrics["tool/malformed"] == 0
    context: list[int] = []
    for turn, prompt in zip(traj.turns, engine.prompts, strict=True):
        context = [*context, *turn.prompt_ids]
        assert context == prompt
        context = [*context, *turn.response_ids]


def _fresh_render(engine: LoopEngine, messages: list[dict[str, Any]]) -> list[int]:
    chat = SETTINGS.chat_format(engine.tokenizer)
    return chat.encode(chat.render_messages(messages, generation_prompt=True, tools=TOOLS))


WORDS = st.text(alphabet="abcdefghij XYZ.,?!0123456789", min_size=1, max_size=30)


@st.composite
def conversations(draw: Any) -> tuple[list[str], list[str]]:
    """An agent's plan (user messages, or "tools": answer the calls) and the model's text
    per call (a call, two calls, or an answer; some cut before the end-of-turn token)."""
    n = draw(st.integers(1, 5))
    plan, texts = [], []
    for i in range(n):
        plan.append(draw(WORDS) if i == 0 or draw(st.booleans()) else "tools")
        kind = draw(st.sampled_from(["answer", "call", "two calls", "cut"]))
        a, b = draw(st.integers(0, 99)), draw(st.integers(0, 99))
        if kind == "answer":
            texts.append(draw(WORDS) + EOT)
        elif kind == "call":
            texts.append(call("add", a=a, b=b) + EOT)
        elif kind == "two calls":
            texts.append(call("add", a=a, b=b) + "\n" + call("add", a=b, b=a) + EOT)
        else:
            texts.append(draw(WORDS))  # no end-of-turn token: cut at max_tokens
    return plan, texts


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(conversations())
def test_an_append_only_agent_gives_a_fresh_render(
    engine: LoopEngine, env: AgentEnv, conversation: tuple[list[str], list[str]]
) -> None:
    """Each call's prompt is the recorded row so far, and equals a fresh render of the
    messages that call sent (the agent only appends; the template is append-only)."""
    plan, texts = conversation
    traj = run(engine, env, plan, texts)
    assert traj.prefix_breaks == 0 and len(traj.turns) == len(plan)
    context: list[int] = []
    for turn, prompt, messages in zip(traj.turns, engine.prompts, env.sent, strict=True):  # type: ignore[attr-defined]
        context = [*context, *turn.prompt_ids]
        assert context == prompt
        assert context == _fresh_render(engine, messages)
        context = [*context, *turn.response_ids]


@pytest.mark.parametrize(("said", "plain"), [("Let me add.", False), ("", False), ("", True)])
def test_a_streamed_call_gives_the_same_message_in_chunks(
    engine: LoopEngine, said: str, plain: bool
) -> None:
    """The answer comes in one piece (this engine makes it at once): the parser still
    gets it token by token, and the call's arguments are in the chunks. ``plain``: the
    tiny model's own tokenizer, where ``<tool_call>`` is several tokens (vLLM's hermes
    streaming parser, given all of it in one delta, sent no arguments there)."""
    if plain:
        from transformers import AutoTokenizer

        from rollpipe.training.tiny_model import default_model_path

        engine = LoopEngine(AutoTokenizer.from_pretrained(str(default_model_path())))
    got: dict[str, Any] = {"content": "", "calls": [], "finish": None, "usage": None}

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        stream = await client.chat.completions.create(
            model="m",
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                got["usage"] = chunk.usage.completion_tokens
            for choice in chunk.choices:
                got["content"] += choice.delta.content or ""
                for c in choice.delta.tool_calls or []:  # a call comes in pieces
                    if c.index == len(got["calls"]):
                        got["calls"].append({"id": c.id, "name": "", "arguments": ""})
                    got["calls"][c.index]["name"] += c.function.name or ""
                    got["calls"][c.index]["arguments"] += c.function.arguments or ""
                got["finish"] = choice.finish_reason or got["finish"]
        return 1.0

    engine.script([said + call("add", a=1, b=2) + EOT])
    chat = SETTINGS.chat_format(engine.tokenizer)
    env = AgentEnv(agent, task=lambda seed: "What is 1 + 2?")
    try:
        traj = engine.runtime.call(env.run_episode(EpisodeSpec(0, 0, 0), engine, chat, SETTINGS))
    finally:
        env.close()
        if plain:
            engine.runtime.close()
    assert traj.error is None and len(traj.turns) == 1
    assert got == {
        "content": said,
        "calls": [{"id": "call_0_0", "name": "add", "arguments": '{"a": 1, "b": 2}'}],
        "finish": "tool_calls",
        "usage": len(traj.turns[0].response_ids),
    }


def test_requests_wait_while_suspended_and_an_abort_is_regenerated(engine: LoopEngine) -> None:
    """The session's ``admit`` (the pipeline's suspension) holds requests; a request the
    engine aborts (suspend with mode="abort") is sent again and recorded once."""
    import asyncio
    import threading

    from waiting import holds_for, wait_until

    from rollpipe.engines.records import Generation
    from rollpipe.frontdoor import FrontDoor

    engine.script(["It is 5." + EOT, "It is 5." + EOT])
    chat = SETTINGS.chat_format(engine.tokenizer)
    original = engine.generate

    async def abort_first(prompt_ids: Any, params: Any) -> Generation:
        gen = await original(prompt_ids, params)
        if len(engine.prompts) == 1:  # the first request: aborted after two tokens
            return Generation(gen.token_ids[:2], gen.logprobs[:2], "abort", gen.versions[:2])
        return gen

    gate = asyncio.Event()

    async def admit() -> None:
        await gate.wait()

    engine.generate = abort_first  # type: ignore[method-assign]
    try:
        with FrontDoor(engine, chat, SETTINGS) as door:
            session = door.open_session(admit=admit)
            replies: list[Any] = []

            async def ask() -> None:
                async with openai.AsyncOpenAI(
                    base_url=door.url, api_key=session.key, max_retries=0
                ) as client:
                    hi = [{"role": "user", "content": "What is 2 + 3?"}]
                    replies.append(await client.chat.completions.create(model="m", messages=hi))  # type: ignore[arg-type]

            agent = threading.Thread(target=asyncio.run, args=(ask(),))
            agent.start()
            wait_until(lambda: session.in_flight, 30, "the request at the front door")
            holds_for(lambda: not engine.prompts, 0.2, "no request reaches the engine")
            engine.runtime.call_soon(gate.set)  # resume
            agent.join(60)
            traj = door.finish(session.key, reward=1.0)
    finally:
        del engine.generate
    assert not agent.is_alive() and replies[0].choices[0].message.content == "It is 5."
    assert len(engine.prompts) == 2 and engine.prompts[0] == engine.prompts[1]
    assert len(traj.turns) == 1 and traj.aborted_tokens == 2
    assert list(traj.turns[0].response_ids) == engine.responses[1]
