"""``stream=true`` through the real front door and the real ``openai`` client, with an
engine that produces a scripted answer one token at a time and can be held between
tokens: a piece reaches the client while the engine still holds the rest (no timing), an
aborted stream continues from its tokens, a stop string is never streamed past, a tool
call streamed in pieces adds up to the recorded message, and an engine that answers a
request again from its start (rollpipe's pool continues instead: tests/test_pool.py)
ends the stream with an error, not with an answer the client cannot rebuild."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any

import openai
import pytest
from tool_support import add, call, tools_model_path

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.agent.tools import tool_set
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.frontdoor import AgentEnv
from rollpipe.runtime import Runtime

EOT = "<|im_end|>"
SETTINGS = EpisodeSettings(tool_parser="hermes", max_length=4096, sampling={"max_tokens": 200})
TOOLS = [dict(s) for s in tool_set([add]).schemas]


class SteppingEngine:
    """Answers with the script's next text, handing its ids to ``on_tokens`` one at a
    time. With ``hold_at=n`` it stops after ``n`` tokens until ``release`` is set, then
    goes on, or ends the request as aborted if ``abort`` is set (a pause in abort mode)."""

    version = 0
    is_paused = False
    interruptions = 0

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.runtime = Runtime("stepping-engine")
        self.texts: list[str] = []
        self.prompts: list[list[int]] = []
        self.emitted: list[int] = []
        self.hold_at: int | None = None
        self.abort = False
        self.restart = False  # answer from the script's start again (a pool's re-send)
        self.release = asyncio.Event()

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, on_tokens: Any = None
    ) -> Generation:
        first = not self.prompts
        self.prompts.append(list(prompt_ids))
        text = self.texts[0] if first or self.restart else self.texts[-1]
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not first and not self.restart and self.abort:
            ids = ids[self.hold_at :]  # the rest of the answer, after the aborted part
        out: list[int] = []
        for i, token in enumerate(ids[: params.max_tokens]):
            if first and i == self.hold_at:
                await self.release.wait()
                if self.abort or self.restart:
                    return Generation(out, [-0.5] * len(out), "abort", [0] * len(out))
            out.append(token)
            self.emitted.append(token)
            if on_tokens is not None:
                on_tokens([token])
            await asyncio.sleep(0)  # the next token is a later step
        reason = (
            "stop" if out and out[-1] == self.tokenizer.convert_tokens_to_ids(EOT) else "length"
        )
        return Generation(out, [-0.5] * len(out), reason, [0] * len(out))


@pytest.fixture
def engine() -> Iterator[SteppingEngine]:
    from transformers import AutoTokenizer

    e = SteppingEngine(AutoTokenizer.from_pretrained(str(tools_model_path())))
    yield e
    e.runtime.close()


def run(engine: SteppingEngine, agent: Any) -> Trajectory:
    chat = SETTINGS.chat_format(engine.tokenizer)
    env = AgentEnv(agent, task=lambda seed: "What is 1 + 2?")
    try:
        spec = EpisodeSpec(0, 0, 0, "agent")
        return engine.runtime.call(env.run_episode(spec, engine, chat, SETTINGS))  # type: ignore[no-any-return]
    finally:
        env.close()


async def read(stream: Any, got: dict[str, Any], on_first: Any = None) -> None:
    """Rebuild the message from ``stream`` as an agent does; ``on_first`` runs when the
    first piece of content arrives."""
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                if not got["content"] and on_first is not None:
                    on_first()
                got["content"] += delta.content
                got["pieces"] += 1
            for c in delta.tool_calls or []:
                if c.index == len(got["calls"]):
                    got["calls"].append({"id": c.id, "name": "", "arguments": ""})
                got["calls"][c.index]["name"] += c.function.name or ""
                got["calls"][c.index]["arguments"] += c.function.arguments or ""
            got["finish"] = choice.finish_reason or got["finish"]


def empty() -> dict[str, Any]:
    return {"content": "", "pieces": 0, "calls": [], "finish": None}


def test_a_piece_reaches_the_client_while_the_engine_holds_the_rest(
    engine: SteppingEngine,
) -> None:
    engine.texts, engine.hold_at = ["Three is the sum of one and two." + EOT], 3
    got, at_first = empty(), []

    def first_piece() -> None:
        at_first.append(len(engine.emitted))  # what the engine had made by then
        engine.release.set()

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        hi = [{"role": "user", "content": task}]
        stream = await client.chat.completions.create(model="m", messages=hi, stream=True)  # type: ignore[call-overload]
        await read(stream, got, first_piece)
        return 1.0

    traj = run(engine, agent)
    assert at_first == [3]  # the first piece came while the engine was held at token 3
    assert got["content"] == "Three is the sum of one and two." and got["pieces"] > 1
    assert got["finish"] == "stop" and traj.error is None
    assert list(traj.turns[0].response_ids) == engine.emitted


def test_an_aborted_stream_continues_from_its_tokens(engine: SteppingEngine) -> None:
    text = "Three is the sum of one and two." + EOT
    engine.texts, engine.hold_at, engine.abort = [text], 4, True
    got: dict[str, Any] = empty()

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        hi = [{"role": "user", "content": task}]
        stream = await client.chat.completions.create(model="m", messages=hi, stream=True)  # type: ignore[call-overload]
        await read(stream, got, engine.release.set)
        return 1.0

    traj = run(engine, agent)
    ids = list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    first, second = engine.prompts
    assert second == [*first, *ids[:4]]  # the continuation's prompt: prompt + what came
    assert got["content"] == text.removesuffix(EOT)  # nothing sent twice, nothing missing
    assert list(traj.turns[0].response_ids) == ids and traj.aborted_tokens == 0
    assert traj.error is None and len(traj.turns) == 1


def test_a_stop_string_is_never_streamed_past(engine: SteppingEngine) -> None:
    engine.texts = ["Thought: add.\nObservation: 9 and more" + EOT]
    got: dict[str, Any] = empty()

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        hi = [{"role": "user", "content": task}]
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=hi, stream=True, stop=["\nObservation:"]
        )
        await read(stream, got)
        return 1.0

    traj = run(engine, agent)
    assert got["content"] == "Thought: add." and got["finish"] == "stop"
    said = engine.tokenizer.decode(list(traj.turns[0].response_ids))
    assert said.endswith(":") and "9" not in said  # the row ends where the stop string does


def test_a_tool_call_streamed_in_pieces_adds_up_to_the_recorded_message(
    engine: SteppingEngine,
) -> None:
    engine.texts = ["Let me add." + call("add", a=1, b=2) + EOT, "It is 3." + EOT]
    got: dict[str, Any] = empty()
    second: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        messages: list[Any] = [{"role": "user", "content": task}]
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model="m", messages=messages, tools=TOOLS, stream=True
        )
        await read(stream, got)
        calls = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in got["calls"]
        ]
        messages.append({"role": "assistant", "content": got["content"], "tool_calls": calls})
        messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "3"})
        engine.texts = engine.texts[1:]
        second.append(
            await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        )  # type: ignore[arg-type]
        return 1.0

    traj = run(engine, agent)
    assert got["content"] == "Let me add." and got["finish"] == "tool_calls"
    assert [(c["id"], c["name"]) for c in got["calls"]] == [("call_0_0", "add")]
    assert json.loads(got["calls"][0]["arguments"]) == {"a": 1, "b": 2}
    # the message rebuilt from the pieces is the one the session holds: no break
    assert traj.error is None and traj.prefix_breaks == 0 and len(traj.turns) == 2
    assert second[0].choices[0].message.content == "It is 3."


def test_a_request_sent_again_from_its_start_ends_the_stream_with_an_error(
    engine: SteppingEngine,
) -> None:
    engine.texts, engine.hold_at, engine.restart = ["One two three four five." + EOT], 3, True
    got: dict[str, Any] = empty()

    async def resent(prompt_ids: Any, params: Any, *, on_tokens: Any = None) -> Generation:
        gen = await SteppingEngine.generate(engine, prompt_ids, params, on_tokens=on_tokens)
        if gen.finish_reason == "abort":  # what an engine pool does when a rank leaves
            return await SteppingEngine.generate(engine, prompt_ids, params, on_tokens=on_tokens)
        return gen

    engine.generate = resent  # type: ignore[method-assign]

    async def agent(client: openai.AsyncOpenAI, task: str) -> float:
        hi = [{"role": "user", "content": task}]
        stream = await client.chat.completions.create(model="m", messages=hi, stream=True)  # type: ignore[call-overload]
        with pytest.raises(openai.APIError, match="does not continue the tokens"):
            await read(stream, got, engine.release.set)
        return 1.0

    traj = run(engine, agent)
    assert got["finish"] is None  # the stream ended with the error, not an answer
    assert traj.error is not None and "StreamBroken" in traj.error
