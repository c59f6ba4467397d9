"""What the front door asks of the engine beyond plain sampling, on the real vLLM engine
with the real ``openai`` client: forced tool calls (``tool_choice`` ``"required"`` or a
named function, through vLLM's structured outputs, chosen per parser as vLLM chooses),
``top_logprobs``, and ``stream=true`` token by token. Every answer is checked against
what the engine produced, recorded at the engine boundary."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import attrs
import openai
import pytest
from tool_support import add, divide

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.agent.tools import tool_set
from rollpipe.frontdoor import AgentEnv

SETTINGS = EpisodeSettings(tool_parser="hermes", max_length=1536, sampling={"max_tokens": 48})
TOOLS = [dict(s) for s in tool_set([add, divide]).schemas]


@pytest.fixture(scope="module")
def engine(tools_vllm_engine: Any) -> Iterator[Any]:
    """The shared tools-model engine, each request's params and answer recorded."""
    e = tools_vllm_engine
    generate = e.generate
    e.seen = []

    async def recorded(prompt_ids: Any, params: Any, **kw: Any) -> Any:
        pieces: list[list[int]] = []
        on_tokens = kw.get("on_tokens")
        if on_tokens is not None:
            kw["on_tokens"] = lambda ids: (pieces.append(list(ids)), on_tokens(ids))
        gen = await generate(prompt_ids, params, **kw)
        e.seen.append((list(prompt_ids), params, gen, pieces))
        return gen

    e.generate = recorded
    try:
        yield e
    finally:
        del e.generate, e.seen


@pytest.fixture
def chat(engine: Any) -> Any:
    from transformers import AutoTokenizer

    from rollpipe.training.tiny_model import default_model_path

    engine.seen.clear()
    return SETTINGS.chat_format(AutoTokenizer.from_pretrained(str(default_model_path(tools=True))))


def run(engine: Any, chat: Any, agent: Any, settings: EpisodeSettings = SETTINGS) -> Trajectory:
    env = AgentEnv(agent, task=lambda seed: "What is 6 / 3?")
    try:
        spec = EpisodeSpec(0, 11, 4, "agent")
        return engine.runtime.call(env.run_episode(spec, engine, chat, settings))  # type: ignore[no-any-return]
    finally:
        env.close()


@pytest.mark.parametrize("parser", ["hermes", None])
def test_a_named_tool_choice_forces_that_call(engine: Any, chat: Any, parser: str | None) -> None:
    """hermes: vLLM's structural tag holds the model to its own call markup, name fixed;
    no parser: vLLM's JSON schema of the function's arguments, read back from the JSON."""
    replies: list[Any] = []
    settings = attrs.evolve(SETTINGS, tool_parser=parser)
    chat = settings.chat_format(chat.tokenizer)

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        for _ in range(2):  # the forced call, its result, and one more forced call
            reply = await client.chat.completions.create(
                model="m",
                messages=messages,
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice={"type": "function", "function": {"name": "divide"}},
                max_tokens=200,
            )
            replies.append(reply)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for c in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": c.id, "content": "2.0"})
        return 1.0

    traj = run(engine, chat, agent, settings)
    assert traj.error is None and traj.prefix_breaks == 0 and len(traj.turns) == 2
    for reply, turn, (_, params, gen, _) in zip(replies, traj.turns, engine.seen, strict=True):
        assert turn.response_ids == gen.token_ids
        outputs = json.loads(params.structured_outputs)
        said = chat.decode_for_parsing(list(gen.token_ids))
        if parser == "hermes":
            assert set(outputs) == {"structural_tag"}
            assert said.startswith("<tool_call>") and '{"name": "divide"' in said[:40]
            if gen.finish_reason != "stop":  # cut inside the call by max_tokens
                continue
        else:  # the function's own parameters schema; the model's tokens are that JSON
            schema = outputs["json"]
            assert schema["required"] == ["a", "b"] and set(schema["properties"]) == {"a", "b"}
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "divide" and reply.choices[0].finish_reason == "tool_calls"
        arguments = json.loads(call.function.arguments)
        if parser is None:
            assert set(arguments) == {"a", "b"} and turn.action_valid is True
            assert all(isinstance(v, (int, float)) for v in arguments.values())
            assert json.loads(said) == arguments


def test_a_required_tool_choice_forces_at_least_one_known_call(engine: Any, chat: Any) -> None:
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": task}],
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
        )
        replies.append(reply)
        return 1.0

    traj = run(engine, chat, agent)
    (_, params, gen, _), (reply,) = engine.seen[0], replies
    (tag,) = json.loads(params.structured_outputs)  # hermes: its own markup, one call
    assert tag == "structural_tag" and traj.error is None
    assert traj.turns[0].response_ids == gen.token_ids
    said = chat.decode_for_parsing(list(gen.token_ids))
    assert said.startswith("<tool_call>") and said.count("<tool_call>") == 1
    if gen.finish_reason == "stop":  # the call closed within max_tokens
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name in ("add", "divide") and call.id == "call_0_0"
        assert traj.env_metrics["tool/calls"] == 1.0
    else:  # cut short: no call, counted as malformed, never a silent empty call
        assert not reply.choices[0].message.tool_calls and not traj.turns[0].action_valid


def test_top_logprobs_are_the_engines_top_k_for_each_token(engine: Any, chat: Any) -> None:
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": task}],
            logprobs=True,
            top_logprobs=4,
            max_tokens=12,
            extra_body={"ignore_eos": True},
        )
        replies.append(reply)
        return 1.0

    traj = run(engine, chat, agent)
    (_, params, gen, _), (reply,) = engine.seen[0], replies
    assert traj.error is None and params.top_logprobs == 4
    content = reply.choices[0].logprobs.content
    assert len(content) == len(gen.token_ids) == 12 == len(gen.top_logprobs)
    for entry, sampled, logprob, top in zip(
        content, gen.token_ids, gen.logprobs, gen.top_logprobs, strict=True
    ):
        assert entry.logprob == logprob
        assert len(entry.top_logprobs) == 4 == len(top)
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) == [lp for _, lp in top]
        assert [t.token for t in entry.top_logprobs] == [chat.tokenizer.decode([i]) for i, _ in top]
        assert logprob <= values[0] + 1e-6  # nothing is likelier than the most likely
        if sampled in dict(top):
            assert dict(top)[sampled] == pytest.approx(logprob)


def test_a_streamed_answer_arrives_in_pieces_as_the_engine_makes_them(
    engine: Any, chat: Any
) -> None:
    pieces: list[str] = []
    finish: list[Any] = []
    whole: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        stream = await client.chat.completions.create(
            model="m",
            messages=messages,
            stream=True,
            max_tokens=24,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    finish.append((choice.finish_reason, choice.logprobs))
        messages.append({"role": "assistant", "content": "".join(pieces)})
        messages.append({"role": "user", "content": "And 8 / 2?"})
        whole.append(await client.chat.completions.create(model="m", messages=messages))
        return 1.0

    traj = run(engine, chat, agent)
    (_, _, gen, sent), second = engine.seen[0], engine.seen[1]
    assert traj.error is None and traj.prefix_breaks == 0 and len(traj.turns) == 2
    # the engine hands over one piece per step (the door sends what has arrived each
    # time it writes: a chunk per piece, or several pieces in one when the client lags)
    assert len(sent) == 24 and [t for p in sent for t in p] == list(gen.token_ids)
    assert 1 <= len(pieces) <= 24
    text = chat.decode_for_parsing(list(gen.token_ids))
    assert "".join(pieces) == text  # what the client rebuilt is what the session holds
    ((reason, logprobs),) = finish
    assert reason == "length" and [c.logprob for c in logprobs.content] == list(gen.logprobs)
    # the streamed answer's tokens are kept: the next prompt continues them exactly
    assert second[0][: len(engine.seen[0][0]) + 24] == [*engine.seen[0][0], *gen.token_ids]
    assert traj.turns[0].response_ids == gen.token_ids


def test_a_streamed_forced_call_adds_up_to_the_recorded_message(engine: Any, chat: Any) -> None:
    calls: list[dict[str, str]] = []
    second: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        stream = await client.chat.completions.create(
            model="m",
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "add"}},
            max_tokens=200,
            stream=True,
        )
        content = ""
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for c in choice.delta.tool_calls or []:  # a call comes in pieces
                    if c.index == len(calls):
                        calls.append({"id": c.id or "", "name": "", "arguments": ""})
                    calls[c.index]["name"] += c.function.name or ""
                    calls[c.index]["arguments"] += c.function.arguments or ""
        functions = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": f}
                for c, f in zip(calls, functions, strict=True)
            ]
        messages.append(message)
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": "5"})
        if not calls:
            messages.append({"role": "user", "content": "Again."})
        second.append(await client.chat.completions.create(model="m", messages=messages))
        return 1.0

    traj = run(engine, chat, agent)
    (_, params, gen, _) = engine.seen[0]
    assert "structural_tag" in json.loads(params.structured_outputs)
    said = chat.decode_for_parsing(list(gen.token_ids))
    assert said.startswith('<tool_call>\n{"name": "add", "arguments": ')  # name held
    assert traj.error is None and len(traj.turns) == 2
    if gen.finish_reason != "stop":  # cut inside the call by max_tokens
        return
    assert [(c["id"], c["name"]) for c in calls] == [("call_0_0", "add")]
    # the tag holds the arguments to the tool's schema (an object) though "add" is not
    # strict; the message rebuilt from the pieces is the one the session holds: one row
    assert isinstance(json.loads(calls[0]["arguments"]), dict)
    assert traj.prefix_breaks == 0 and traj.turns[0].constrained
