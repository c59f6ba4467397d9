"""Request features of the front door through the real ``openai`` client: ``stop``
strings cut the response where vLLM would (the row keeps the model's tokens up to the
cut, and the next call continues from them), and what the server does not do (``n > 1``,
forced tool calls, ``top_logprobs``) is a 400 naming the field and the value sent.

The model's text is scripted (the tools model's real tokenizer, template and parser): a
stop string must appear at a chosen place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tool_support import ScriptedEngine, add, call, tools_model_path

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec
from rollpipe.agent.tools import tool_set
from rollpipe.data.rows import trajectory_rows
from rollpipe.frontdoor import AgentEnv, FrontDoor
from rollpipe.runtime import Runtime

EOT = "<|im_end|>"
SETTINGS = EpisodeSettings(tool_parser="hermes", max_length=4096, sampling={"max_tokens": 200})
TOOLS = [dict(s) for s in tool_set([add]).schemas]


class LoopEngine(ScriptedEngine):
    """The scripted engine on a runtime of its own, as the front door needs."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, [])
        self.runtime = Runtime("scripted-engine")
        self.params: list[Any] = []

    async def generate(self, prompt_ids: Any, params: Any, **kw: Any) -> Any:
        self.params.append(params)
        return await super().generate(prompt_ids, params, **kw)


@pytest.fixture
def engine() -> Iterator[LoopEngine]:
    from transformers import AutoTokenizer

    e = LoopEngine(AutoTokenizer.from_pretrained(str(tools_model_path())))
    yield e
    e.runtime.close()


def test_a_stop_string_cuts_the_reply_and_the_row_keeps_the_models_tokens(
    engine: LoopEngine,
) -> None:
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        for observation in ("7", "done"):
            reply = await client.chat.completions.create(
                model="m",
                messages=messages,
                stop=["\nObservation:", "NEVER"],
                logprobs=True,
            )
            replies.append(reply)
            messages.append(reply.choices[0].message)
            messages.append({"role": "user", "content": f"Observation: {observation}"})
        return 1.0

    engine.texts = ["Thought: add.\nObservation: 9 and more" + EOT, "It is 7." + EOT]
    chat = SETTINGS.chat_format(engine.tokenizer)
    env = AgentEnv(agent, task=lambda seed: "What is 3 + 4?")
    try:
        traj = engine.runtime.call(env.run_episode(EpisodeSpec(0, 0, 0), engine, chat, SETTINGS))
    finally:
        env.close()
    first, second = (r.choices[0] for r in replies)
    assert first.message.content == "Thought: add." and first.finish_reason == "stop"
    assert second.message.content == "It is 7." and second.finish_reason == "stop"
    cut = traj.turns[0].response_ids
    sampled = engine.responses[0]
    assert cut == tuple(sampled[: len(cut)]) and len(cut) < len(sampled)  # a prefix
    said = engine.tokenizer.decode(list(cut))
    assert said.endswith(":") and "\nObservation:" in said  # up to the completing token
    assert "\nObservation:" not in engine.tokenizer.decode(list(cut[:-1]))
    assert len(first.logprobs.content) == len(cut) == replies[0].usage.completion_tokens
    assert traj.error is None and traj.prefix_breaks == 0 and len(traj.turns) == 2
    # the second call's prompt continues from the kept tokens: one exact row
    assert engine.prompts[1][: len(engine.prompts[0]) + len(cut)] == [*engine.prompts[0], *cut]
    row = trajectory_rows([traj], pad_token_id=0)
    n = int(row.batch["attention_mask"].sum())
    assert row.batch["input_ids"][0, :n].tolist() == [*engine.prompts[1], *engine.responses[1]]


def test_a_stop_string_that_does_not_appear_changes_nothing(engine: LoopEngine) -> None:
    engine.texts = [call("add", a=1, b=2) + EOT]
    with FrontDoor(engine, engine.tokenizer, SETTINGS) as door:
        session = door.open_session()

        async def ask() -> Any:
            async with openai.AsyncOpenAI(
                base_url=door.url, api_key=session.key, max_retries=0
            ) as client:
                hi = [{"role": "user", "content": "1 + 2?"}]
                return await client.chat.completions.create(
                    model="m",
                    messages=hi,  # type: ignore[arg-type]
                    tools=TOOLS,  # type: ignore[arg-type]
                    stop="Observation",
                )

        reply = asyncio.run(ask())
        traj = door.finish(session.key)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.tool_calls[0].function.name == "add"
    assert list(traj.turns[0].response_ids) == engine.responses[0]


def test_vllms_ignore_eos_reaches_the_engine(engine: LoopEngine) -> None:
    engine.texts = ["a b c", "a b c"]
    eot = engine.tokenizer.convert_tokens_to_ids(EOT)
    with FrontDoor(engine, engine.tokenizer, SETTINGS) as door:
        session = door.open_session()

        async def ask(extra: dict[str, Any]) -> None:
            async with openai.AsyncOpenAI(
                base_url=door.url, api_key=session.key, max_retries=0
            ) as client:
                hi = [{"role": "user", "content": "count"}]
                await client.chat.completions.create(model="m", messages=hi, extra_body=extra)  # type: ignore[arg-type]

        asyncio.run(ask({"ignore_eos": True}))
        asyncio.run(ask({}))
    ignoring, default = engine.params
    assert ignoring.ignore_eos and eot not in ignoring.stop_token_ids
    assert not default.ignore_eos and eot in default.stop_token_ids


NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize(
    ("extra", "param", "shown"),
    [
        ({"n": 2}, "n", "n=2"),
        ({"n": 4}, "n", "n=4"),
        # what this engine cannot do (the scripted one has no structured outputs or
        # top-k logprobs; a vLLM engine honours both, tests/test_frontdoor_forced.py)
        ({"tool_choice": "required", "tools": TOOLS}, "tool_choice", "'required'"),
        ({"tool_choice": NAMED, "tools": TOOLS}, "tool_choice", "tool_choice='add'"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs", "top_logprobs=3"),
        # what no engine can do
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"function": {"name": "mul"}}, "tools": TOOLS}, "tool_choice", "'mul'"),
        ({"tool_choice": "any", "tools": TOOLS}, "tool_choice", "'any'"),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs=true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "'no'"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "'e'"),
        ({"stop": ["ok", ""]}, "stop", "stop[1]"),
        ({"stop": 7}, "stop", "7"),
        ({"ignore_eos": "yes"}, "ignore_eos", "'yes'"),
    ],
)
def test_what_the_server_does_not_do_is_a_400_naming_field_and_value(
    engine: LoopEngine, extra: dict[str, Any], param: str, shown: str
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with FrontDoor(engine, engine.tokenizer, SETTINGS) as door:
        session = door.open_session()

        async def send() -> Any:
            async with openai.AsyncOpenAI(
                base_url=door.url, api_key=session.key, max_retries=0
            ) as client:
                return await client.post("/chat/completions", body=body, cast_to=object)

        with pytest.raises(openai.BadRequestError) as caught:
            asyncio.run(send())
        assert session.calls == 0
    assert caught.value.status_code == 400 and caught.value.param == param
    assert shown in caught.value.message, caught.value.message
    assert engine.prompts == []  # nothing reached the engine
