"""Images in tool results, and images after a text start, on the tiny VLM's vLLM engine.

A tool that returns a PIL image (or content parts) answers with a tool message holding
its text and, after the turn's tool messages, one user message with the images (the env
contract takes content parts in user messages); the episode's image conversation renders
them, and the rows equal the processor's expanded render. The model side is scripted (the
tiny random model writes no tool calls), but every request goes to the real engine, whose
reported expansion the conversation checks. An env whose first observation is text and a
later one an image runs the image conversation from the start (the engine supports
images)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from pictures import pil, random_image
from transformers import AutoTokenizer

import rollpipe.vision.conversation as image_conversation
from rollpipe.agent.actions import AssistantAction, ToolCall
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec
from rollpipe.agent.tool_runner import ToolRunner
from rollpipe.agent.tools import ToolSet
from rollpipe.data.rows import trajectory_rows
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT, ToolEnv

CALL = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call><|im_end|>'
ANSWER = "a red square<|im_end|>"
SETTINGS = EpisodeSettings(
    max_turns=3, max_length=1536, tool_parser="hermes", sampling={"max_tokens": 64}
)
PICTURE = pil(random_image(11))


def look() -> Any:
    """Look at the scene."""
    return PICTURE


def look_parts() -> Any:
    """Look at the scene, described."""
    return [{"type": "text", "text": "x" * 50}, {"type": "image", "image": PICTURE}]


class ScriptedVLM:
    """The scripted texts as the model's answers; each request also goes to the real VLM
    engine (one token), whose expanded prompt the answer reports."""

    version = 0
    is_paused = False
    interruptions = 0

    def __init__(self, engine: Any, tokenizer: Any, texts: Sequence[str]) -> None:
        self.engine, self.tokenizer, self.texts = engine, tokenizer, list(texts)
        self.runtime = engine.runtime
        self.requests: list[tuple[list[int], int]] = []

    def supports(self, feature: str) -> bool:
        return feature == "images"

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_tokens: Any = None,
        images: Sequence[Any] = (),
    ) -> Generation:
        text = self.texts[min(len(self.requests), len(self.texts) - 1)]
        self.requests.append((list(prompt_ids), len(images)))
        real = await self.engine.generate(prompt_ids, params.replace(max_tokens=1), images=images)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return Generation(
            ids, [-0.5] * len(ids), "stop", [0] * len(ids), prompt_token_ids=real.prompt_token_ids
        )


@pytest.fixture(scope="module")
def tokenizer(vlm_path: Any) -> Any:
    return AutoTokenizer.from_pretrained(str(vlm_path))


def expanded(processor: Any, messages: list[dict[str, Any]], images: list[Any]) -> Any:
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images or None, return_tensors="pt")


def episode(vlm_engine: Any, tokenizer: Any, env: Any, texts: Sequence[str]) -> Any:
    engine = ScriptedVLM(vlm_engine, tokenizer, texts)
    chat = SETTINGS.chat_format(tokenizer)
    spec = EpisodeSpec(group_id=0, episode_id=3, seed=4, env_name="look")
    try:
        traj = vlm_engine.runtime.call(run_episode(spec, env, engine, chat, SETTINGS))
    finally:
        env.close()
    return traj, engine


def test_a_tool_that_returns_an_image(vlm_engine: Any, tokenizer: Any, processor: Any) -> None:
    env = ToolEnv(lambda seed: ("What do you see?", "red"), [look], lambda a, t: float(t in a))
    traj, engine = episode(vlm_engine, tokenizer, env, [CALL, ANSWER])
    assert traj.error is None and traj.end_reason == "terminated" and traj.score == 1.0
    assert all(isinstance(u, image_conversation.ImageTurn) for u in traj.turns)
    assert [u.num_images for u in traj.turns] == [0, 1]
    assert [n for _, n in engine.requests] == [0, 1]  # the image goes with the second request
    messages = [
        {"role": "system", "content": DEFAULT_TOOL_PROMPT},
        {"role": "user", "content": "What do you see?"},
        {"role": "assistant", "content": CALL.removesuffix("<|im_end|>")},
        {"role": "tool", "content": ""},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    want = expanded(processor, messages, [PICTURE])
    first, second = traj.turns
    row = [*first.prompt_ids, *first.response_ids, *second.prompt_ids]
    assert row == want["input_ids"][0].tolist()
    assert torch.equal(second.pixel_values, want["pixel_values"])
    (mm,) = trajectory_rows([traj], pad_token_id=0).non_tensor_batch["multi_modal_inputs"]
    assert torch.equal(mm["image_grid_thw"], want["image_grid_thw"])
    assert "<image 64x64>" in second.observation


def test_the_result_cut_applies_to_text_parts_only() -> None:
    runner = ToolRunner(ToolSet([look_parts]), max_result_chars=10)
    call = ToolCall.from_json("call_0", "look_parts", "{}")
    import asyncio

    try:
        results = asyncio.run(runner.run(AssistantAction("", "", [call])))
    finally:
        runner.close()
    tool, shown = results.messages
    assert tool["role"] == "tool" and tool["content"].startswith("x" * 10 + "\n[tool result cut")
    assert shown["role"] == "user" and shown["content"] == [{"type": "image", "image": PICTURE}]
    assert results.counts["tool/cut"] == 1.0 and results.counts["tool/errors"] == 0.0


def test_a_malformed_parts_result_is_the_tools_error() -> None:
    def broken() -> Any:
        """Return a bad part."""
        return [{"type": "image", "image": "not an image"}]

    runner = ToolRunner(ToolSet([broken]))
    import asyncio

    try:
        call = ToolCall.from_json("call_0", "broken", "{}")
        results = asyncio.run(runner.run(AssistantAction("", "", [call])))
    finally:
        runner.close()
    (tool,) = results.messages
    assert results.counts["tool/errors"] == 1.0 and "broken returned" in tool["content"]


class LaterPicture:
    """A chat env whose first observation is text and whose second shows an image."""

    blocking = False

    def reset(self, seed: int) -> tuple[Any, dict[str, Any]]:
        self.steps = 0
        return [{"role": "user", "content": "Wait for the picture."}], {}

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.steps > 1:
            return [{"role": "user", "content": "And?"}], 0.0, False, False, {}
        parts = [{"type": "image", "image": PICTURE}, {"type": "text", "text": "Now?"}]
        return [{"role": "user", "content": parts}], 0.0, False, False, {}

    def close(self) -> None:
        pass


def test_images_after_a_text_start(vlm_engine: Any, tokenizer: Any, processor: Any) -> None:
    traj, engine = episode(vlm_engine, tokenizer, LaterPicture(), ["ok<|im_end|>"])
    assert traj.error is None and traj.num_turns == 3
    assert [u.num_images for u in traj.turns] == [0, 1, 0]
    assert [n for _, n in engine.requests] == [0, 1, 1]  # every image so far, each request
    (mm,) = trajectory_rows([traj], pad_token_id=0).non_tensor_batch["multi_modal_inputs"]
    assert torch.equal(mm["pixel_values"], traj.turns[1].pixel_values)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert list(traj.turns[1].prompt_ids).count(pad) == int(mm["image_grid_thw"].prod()) // 4
