"""Images at the front door, with the real ``openai`` client against a FrontDoor on the
tiny VLM's vLLM engine: an agent sends ``image_url`` parts (data URLs) and gets answers;
the session's row equals the processor's expanded render of the request and holds the
images' pixel_values; bad data URLs, remote URLs, images outside user messages and
images on an engine without image support get 400s naming the part (or the engine)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from pictures import pil, random_image
from tool_support import ScriptedEngine
from transformers import AutoTokenizer

import rollpipe.vision.conversation as image_conversation
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.data.rows import trajectory_rows
from rollpipe.frontdoor import FrontDoor

SETTINGS = EpisodeSettings(max_length=1536, sampling={"max_tokens": 8, "temperature": 0.0})


def data_url(image: Any) -> str:
    png = io.BytesIO()
    image.save(png, "PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def asking(text: str, *images: Any) -> dict[str, Any]:
    """A user message as the OpenAI API takes it: text, then ``image_url`` parts."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"role": "user", "content": parts}


def as_template(message: dict[str, Any]) -> dict[str, Any]:
    """The message as the processor's template takes it (an image part per image)."""
    content = message["content"]
    if isinstance(content, str):
        return message
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    return {**message, "content": parts}


@pytest.fixture(scope="module")
def tokenizer(vlm_path: Any) -> Any:
    return AutoTokenizer.from_pretrained(str(vlm_path))


@pytest.fixture(scope="module")
def door(vlm_engine: Any, tokenizer: Any) -> Iterator[FrontDoor]:
    with FrontDoor(vlm_engine, tokenizer, SETTINGS) as door:
        yield door


def expanded(processor: Any, messages: list[dict[str, Any]], images: list[Any]) -> Any:
    text = processor.apply_chat_template(
        [as_template(m) for m in messages], add_generation_prompt=True, tokenize=False
    )
    return processor(text=[text], images=images or None, return_tensors="pt")


def test_an_agent_sends_an_image_and_its_row_is_the_processors_render(
    door: FrontDoor, processor: Any
) -> None:
    image = pil(random_image(1))
    session = door.open_session()
    messages = [asking("What is in the picture?", image)]
    with openai.OpenAI(base_url=door.url, api_key=session.key) as client:
        reply = client.chat.completions.create(model="rollpipe", messages=messages)
    assert reply.choices[0].message.role == "assistant"
    traj = door.finish(session.key, reward=1.0)
    (turn,) = traj.turns
    assert isinstance(turn, image_conversation.ImageTurn) and turn.num_images == 1
    want = expanded(processor, messages, [image])
    assert list(turn.prompt_ids) == want["input_ids"][0].tolist()  # expanded, as the model saw
    assert torch.equal(turn.pixel_values, want["pixel_values"])
    assert torch.equal(turn.image_grid_thw, want["image_grid_thw"])
    rows = trajectory_rows([traj], pad_token_id=0)
    (mm,) = rows.non_tensor_batch["multi_modal_inputs"]
    assert torch.equal(mm["pixel_values"], want["pixel_values"])
    ids = rows.batch["input_ids"][0].tolist()
    assert ids[: len(turn.prompt_ids) + len(turn.response_ids)] == [
        *turn.prompt_ids,
        *turn.response_ids,
    ]
    assert "<image 64x64>" in turn.observation


def test_a_second_call_with_another_image_continues_the_row(
    door: FrontDoor, processor: Any
) -> None:
    first, second = pil(random_image(2)), pil(random_image(3, 48, 80))
    session = door.open_session()
    messages: list[dict[str, Any]] = [asking("Look.", first)]
    with openai.OpenAI(base_url=door.url, api_key=session.key) as client:
        reply = client.chat.completions.create(model="rollpipe", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append(asking("And now this one?", second))
        reply = client.chat.completions.create(model="rollpipe", messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": "Thanks."})  # a text call after
        client.chat.completions.create(model="rollpipe", messages=messages)
    traj = door.finish(session.key)
    assert session.prefix_breaks == 0 and len(traj.turns) == 3
    assert [u.num_images for u in traj.turns] == [1, 1, 0]
    rows = trajectory_rows([traj], pad_token_id=0)
    assert rows.batch["input_ids"].shape[0] == 1  # one row: the agent extended its messages
    (mm,) = rows.non_tensor_batch["multi_modal_inputs"]
    whole = expanded(processor, messages[:3], [first, second])
    assert torch.equal(mm["pixel_values"], whole["pixel_values"])
    assert torch.equal(mm["image_grid_thw"], whole["image_grid_thw"])
    first_turn = traj.turns[0]
    said = first_turn.response_ids
    # the row up to the second prompt is the processor's render of those messages, the
    # model's answer kept as its own ids (the text it decodes to re-encodes the same)
    row = [i for u in traj.turns[:2] for i in (*u.prompt_ids, *u.response_ids)]
    row = row[: len(row) - len(traj.turns[1].response_ids)]
    reencoded = processor.tokenizer(messages[1]["content"], add_special_tokens=False)
    if list(reencoded["input_ids"]) == [i for i in said if i != processor.tokenizer.eos_token_id]:
        assert row == whole["input_ids"][0].tolist()
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert row.count(pad) == int(whole["image_grid_thw"].prod(dim=1).sum()) // 4


def test_a_text_session_on_the_vlm_is_unchanged(door: FrontDoor, tokenizer: Any) -> None:
    session = door.open_session()
    hi = [{"role": "user", "content": "What is 2 + 3?"}]
    with openai.OpenAI(base_url=door.url, api_key=session.key) as client:
        client.chat.completions.create(model="rollpipe", messages=hi)
    traj = door.finish(session.key)
    (turn,) = traj.turns
    text = tokenizer.apply_chat_template(hi, add_generation_prompt=True, tokenize=False)
    assert list(turn.prompt_ids) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert turn.num_images == 0
    assert "multi_modal_inputs" not in trajectory_rows([traj], pad_token_id=0).non_tensor_batch


def refused(door: FrontDoor, messages: list[dict[str, Any]]) -> openai.BadRequestError:
    session = door.open_session()
    client = openai.OpenAI(base_url=door.url, api_key=session.key, max_retries=0)
    with client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="rollpipe", messages=messages)
    assert door.finish(session.key).num_turns == 0  # nothing recorded
    return caught.value


def _part(url: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("https://example.com/cat.png", "remote URL"),
        ("http://example.com/cat.png", "fetches nothing"),
        ("data:image/png;base64,@@not base64@@", "does not decode"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not an image"),
        ("file:///etc/passwd", "base64 data URL"),
    ],
)
def test_bad_image_urls_get_a_400_naming_the_part(door: FrontDoor, url: str, said: str) -> None:
    error = refused(door, [_part(url)])
    assert error.status_code == 400
    assert said in error.message
    assert error.body["param"] == "messages[0].content[1].image_url.url"  # type: ignore[index]


def test_an_image_outside_a_user_message_is_refused(door: FrontDoor) -> None:
    image = {"type": "image_url", "image_url": {"url": data_url(pil(random_image(4)))}}
    messages = [{"role": "system", "content": [image]}, {"role": "user", "content": "hi"}]
    error = refused(door, messages)
    assert "user messages" in error.message
    assert error.body["param"] == "messages[0].content[0]"  # type: ignore[index]


def test_an_image_on_an_engine_without_images_names_the_engine(
    vlm_engine: Any, tokenizer: Any
) -> None:
    engine = ScriptedEngine(tokenizer, ["hi<|im_end|>"])
    engine.runtime = vlm_engine.runtime  # type: ignore[attr-defined]
    with FrontDoor(engine, tokenizer, SETTINGS) as door:
        error = refused(door, [asking("What is this?", pil(random_image(5)))])
        assert "ScriptedEngine" in error.message and "does not support images" in error.message
        assert error.body["param"] == "messages[0].content[1]"  # type: ignore[index]
        session = door.open_session()  # text still works there
        with openai.OpenAI(base_url=door.url, api_key=session.key) as client:
            client.chat.completions.create(
                model="rollpipe", messages=[{"role": "user", "content": "hi"}]
            )
        assert door.finish(session.key).num_turns == 1
