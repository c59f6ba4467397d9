"""Image rows against transformers' processor, for random conversations with images: the
row built turn by turn (render diff, local expansion) equals the processor's expansion of
the whole conversation rendered at once, and the row's pixel_values are the whole
conversation's. The engine here answers with fixed text and reports the processor's own
expansion of what it was sent (so the conversation's check compares against the
processor, not against itself)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import AutoTokenizer

import rollpipe.vision.conversation  # noqa: F401  (registers the image conversation)
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec
from rollpipe.data.rows import trajectory_rows
from rollpipe.engines.records import Generation
from rollpipe.vision.conversation import ImageTurn

ANSWER = "<answer>Left</answer>"
SIZES = [(64, 64), (90, 60), (56, 112), (28, 84)]  # (height, width)


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


class _ProcessorEngine:
    """Answers ``ANSWER`` and the end of turn; reports the processor's expansion of the
    sent ids (decoded) with the sent images."""

    def __init__(self, processor: Any, response: list[int]) -> None:
        self.processor, self.response = processor, response
        self.sent_images: list[int] = []

    async def generate(
        self, prompt_ids: Any, params: Any, *, on_tokens: Any = None, images: Any = ()
    ) -> Generation:
        text = self.processor.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        out = self.processor(text=[text], images=list(images) or None, return_tensors="pt")
        self.sent_images.append(len(images))
        n = len(self.response)
        return Generation(
            self.response,
            [0.0] * n,
            "stop",
            [0] * n,
            prompt_token_ids=out["input_ids"][0].tolist(),
        )


class _ScriptedImageEnv:
    """Observations from a script: each a user message of text and images."""

    blocking = False

    def __init__(self, observations: list[list[dict[str, Any]]]) -> None:
        self.observations = observations
        self.t = 0

    def reset(self, seed: int) -> tuple[Any, dict[str, Any]]:
        self.t = 0
        return self.observations[0], {}

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.t += 1
        done = self.t == len(self.observations)
        obs = "the end" if done else self.observations[self.t]
        return obs, 1.0, done, False, {}


picture = st.tuples(st.integers(0, 10**6), st.sampled_from(SIZES))


@pytest.fixture(scope="module")
def vlm_tokenizer(vlm_path: Any) -> Any:
    return AutoTokenizer.from_pretrained(str(vlm_path))


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    first=st.lists(picture, min_size=1, max_size=2),
    later=st.lists(st.lists(picture, max_size=2), max_size=3),
    text_first=st.booleans(),
)
def test_rows_equal_the_processors_whole_render(
    processor: Any, vlm_tokenizer: Any, first: Any, later: Any, text_first: bool
) -> None:
    observations = []
    for t, pictures in enumerate([first, *later]):
        parts: list[dict[str, Any]] = [
            {"type": "image", "image": _image(s, size)} for s, size in pictures
        ]
        text = {"type": "text", "text": f"Turn {t}: where next?"}
        parts = [text, *parts] if text_first else [*parts, text]
        observations.append([{"role": "user", "content": parts}])
    chat_settings = EpisodeSettings(max_turns=8, max_length=8192, sampling={"max_tokens": 16})
    chat = chat_settings.chat_format(vlm_tokenizer)
    response = [*vlm_tokenizer.encode(ANSWER), chat.eot_id]
    engine = _ProcessorEngine(processor, response)
    env = _ScriptedImageEnv(observations)
    traj = asyncio.run(run_episode(EpisodeSpec(0, 0, 1), env, engine, chat, chat_settings))  # type: ignore[arg-type]
    assert traj.error is None, traj.error
    assert traj.num_turns == len(observations)
    assert all(isinstance(u, ImageTurn) for u in traj.turns)

    # the whole conversation, rendered at once by the processor and expanded by it
    messages: list[dict[str, Any]] = [*chat.system_messages()]
    for obs in observations:
        messages.extend(obs)
        messages.append({"role": "assistant", "content": ANSWER})
    whole = processor.apply_chat_template(messages, tokenize=False)
    whole = whole[: whole.rindex("<|im_end|>") + len("<|im_end|>")]  # the row ends there
    images = [p["image"] for obs in observations for p in obs[0]["content"] if p["type"] == "image"]
    want = processor(text=[whole], images=images, return_tensors="pt")

    rows = trajectory_rows([traj], pad_token_id=0)
    assert rows.batch["input_ids"][0].tolist() == want["input_ids"][0].tolist()
    (mm,) = rows.non_tensor_batch["multi_modal_inputs"]
    assert torch.equal(mm["pixel_values"], want["pixel_values"])
    assert torch.equal(mm["image_grid_thw"], want["image_grid_thw"])
    # every request carried all the images so far, in order
    counts = [len(p) for p in [first, *later]]
    assert engine.sent_images == [sum(counts[: t + 1]) for t in range(len(counts))]
