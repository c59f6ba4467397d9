"""A big tool result costs only its own episode: its prompt is rendered and tokenized on
the episode's env thread, while the engine's loop keeps serving every other episode.

On the real vLLM engine (the tiny tools model): one episode is forced (a regex) to call a
tool whose result is big; its text is a ``str`` that holds the template's render of it
(the ``+`` the template writes before it) until the test lets it go, and notes the thread
that rendered it. While it is held, the other episodes' engine requests keep arriving,
counted; a render on the loop would stop them all (and is noted as such, not held).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from tool_support import ScriptedEngine, call, tools_model_path

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.conversation import OFF_LOOP_CHARS
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.envs.calculator import last_number_matches
from rollpipe.envs.tool_env import ToolEnv

CALL = '<tool_call>\n{"name": "fetch", "arguments": {}}\n</tool_call>'
EOT = "<|im_end|>"
OTHERS = 4
MORE_REQUESTS = 8  # other episodes' requests that must arrive while the big render is held


class HeldRender(str):
    """A tool result whose render by the chat template (``'...<tool_response>\\n' +
    content``) waits for ``release`` on a worker thread, and is noted, not held, on the
    engine's loop thread (holding it there would stop the test itself)."""

    loop: threading.Thread
    rendering: threading.Event
    release: threading.Event
    on_loop: list[str]

    def __radd__(self, other: str) -> str:
        if other.endswith("<tool_response>\n"):
            if threading.current_thread() is self.loop:
                self.on_loop.append(threading.current_thread().name)
                self.rendering.set()  # the test fails at once
            else:
                self.rendering.set()
                assert self.release.wait(120), "the test never released the held render"
        return str.__add__(other, str(self))


class Counted:
    """The engine, counting the requests made through it (the other episodes')."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.requests = engine, 0
        self.changed = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        with self.changed:
            self.requests += 1
            self.changed.notify_all()
        result: Generation = await self.engine.generate(prompt, params)
        return result

    def wait_for(self, requests: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.requests >= requests, timeout=120)


class Chatter:
    """A text env that never ends: the other episodes (ended by ``max_length``)."""

    blocking = False

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        return "Say something.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "Go on.", 0.0, False, False, {}

    def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def tools_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tools_model_path()))


def test_a_big_tool_result_is_rendered_off_the_loop_while_other_episodes_go_on(
    tools_vllm_engine: Any, tools_tokenizer: Any
) -> None:
    engine = tools_vllm_engine
    held = HeldRender("the page says: " + "lorem ipsum " * (OFF_LOOP_CHARS // 6))
    held.loop, held.on_loop = engine.runtime.thread, []
    held.rendering, held.release = threading.Event(), threading.Event()

    def fetch() -> str:
        """Fetch the page."""
        return held

    tool_env = ToolEnv(lambda seed: ("Fetch the page.", ""), [fetch], last_number_matches)
    forced = SamplingParams(max_tokens=40, seed=0, structured_outputs={"regex": re.escape(CALL)})
    big = EpisodeSettings(max_turns=2, max_length=2048, tool_parser="hermes", sampling=forced)
    chat = EpisodeSettings(max_turns=1000, max_length=1024, sampling={"max_tokens": 4})
    counted = Counted(engine)
    try:
        big_run = engine.runtime.submit(
            run_episode(
                EpisodeSpec(0, 0, 0), tool_env, engine, big.chat_format(tools_tokenizer), big
            )
        )
        others = [
            engine.runtime.submit(
                run_episode(
                    EpisodeSpec(1, 1 + i, i), Chatter(), counted, ChatFormat(tools_tokenizer), chat
                )
            )
            for i in range(OTHERS)
        ]
        assert held.rendering.wait(120), "the big result was never rendered"
        assert held.on_loop == []  # rendered off the engine's loop, and held there
        before = counted.requests
        assert counted.wait_for(before + MORE_REQUESTS)  # the loop serves them meanwhile
        assert not big_run.done() and not held.release.is_set()  # provably still held
    finally:
        held.release.set()
        trajectory = big_run.result(120)
        rest = [o.result(300) for o in others]
        tool_env.close()
    assert held.on_loop == []  # never rendered on the engine's loop
    assert trajectory.error is None, trajectory.error
    assert trajectory.turns[0].action_text.startswith(CALL)  # the forced call, then the result
    assert trajectory.env_metrics["tool/calls"] >= 1 and trajectory.env_metrics["tool/cut"] == 0
    assert all(t.error is None and t.num_turns > MORE_REQUESTS // OTHERS for t in rest)


def test_a_huge_result_is_cut_and_its_off_loop_prompt_is_token_exact(tools_tokenizer: Any) -> None:
    """A result of several MB: cut to ``max_result_chars`` (counted), its prompt rendered
    off the loop and still exactly what a whole render of the conversation gives."""
    import asyncio

    def page() -> str:
        """Fetch a huge page."""
        return "word " * 1_000_000

    engine = ScriptedEngine(tools_tokenizer, [call("page") + EOT, "It is long." + EOT])
    tool_env = ToolEnv(lambda seed: ("Fetch it.", ""), [page], last_number_matches)
    settings = EpisodeSettings(
        max_turns=3, max_length=2**16, tool_parser="hermes", sampling={"max_tokens": 200}
    )
    chat = settings.chat_format(tools_tokenizer)
    try:
        traj = asyncio.run(run_episode(EpisodeSpec(0, 0, 0), tool_env, engine, chat, settings))
    finally:
        tool_env.close()
    assert traj.error is None and traj.num_turns == 2, traj.error
    assert traj.env_metrics["tool/cut"] == 1 and traj.env_metrics["tool/cut/page"] == 1
    shown = traj.turns[1].observation
    assert OFF_LOOP_CHARS < len(shown) < 16_100  # rendered off the loop, and bounded
    context: list[int] = []
    for turn, prompt in zip(traj.turns, engine.prompts, strict=True):
        context = [*context, *turn.prompt_ids]
        assert context == prompt
        context = [*context, *turn.response_ids]
    messages = [
        {"role": "system", "content": tool_env.system_prompt},
        {"role": "user", "content": "Fetch it."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0_0",
                    "type": "function",
                    "function": {"name": "page", "arguments": {}},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_0_0",
            "name": "page",
            "content": shown.removeprefix("[tool page] "),
        },
    ]
    whole = chat.render_messages(messages, generation_prompt=True, tools=tool_env.tools.schemas)
    assert engine.prompts[1] == chat.encode(whole)
