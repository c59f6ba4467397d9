"""What the image tests share: seeded images, rendering a turn, the unexpanded ids."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from rollpipe.engines.records import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def random_image(seed: int, height: int = 64, width: int = 64) -> np.ndarray:
    """An ``height x width x 3`` uint8 image of seeded noise."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def pil(image: np.ndarray) -> Image.Image:
    return Image.fromarray(image, "RGB")


def user(text: str, images: int = 1) -> dict[str, Any]:
    """A user message with ``images`` image parts, then ``text``."""
    return {
        "role": "user",
        "content": [{"type": "image"}] * images + [{"type": "text", "text": text}],
    }


def render(processor: Any, messages: list[dict[str, Any]], generation_prompt: bool = True) -> str:
    text: str = processor.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    return text


def ids_of(processor: Any, text: str) -> list[int]:
    """``text``'s token ids, unexpanded: one ``<|image_pad|>`` per image."""
    ids: list[int] = processor.tokenizer(text)["input_ids"]
    return ids


def expanded_by_processor(processor: Any, text: str, images: list[np.ndarray]) -> list[int]:
    """The processor's own expansion of ``text`` with ``images``."""
    out = processor(text=[text], images=[pil(i) for i in images], return_tensors="pt")
    ids: list[int] = out["input_ids"][0].tolist()
    return ids


def next_turn_text(processor: Any, messages: list[dict[str, Any]], new: dict[str, Any]) -> str:
    """The text a new message adds after an assistant turn (the render diff): from the
    end of the assistant's ``<|im_end|>`` line to the new generation prompt."""
    done = [*messages, {"role": "assistant", "content": "x"}]
    before = render(processor, done, generation_prompt=False)
    return render(processor, [*done, new])[len(before) :]
