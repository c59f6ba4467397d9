"""Checks that catch what vLLM 0.32 silently corrupts in an image conversation.

vLLM takes token ids with ONE ``<|image_pad|>`` per image plus all of the conversation's
images so far, expands each pad and reports the expanded prompt. What breaks that rule
it misreads without an error: already-expanded ids, a wrong number of pads, pads with no
images (read as text), a later turn sent with only its new image (bound to the first
turn's pad), a pad inside a response. Each check here raises ``ImageTokenError`` (a
``ValueError``) naming where (``where``: a turn, a request) and the counts:

* ``check_image_prompt(prompt_ids, num_images, tokens, where)``: one isolated pad per
  image, no video pad (an engine on a VLM runs it on every request);
* ``check_expanded_prompt(reported, expected, where)``: the engine's expanded prompt
  (``Generation.prompt_token_ids``) equals the local expansion
  (``expand_image_pads(prompt_ids, grid_thws, merge_size, pad_id)``);
* ``check_response(token_ids, tokens, where)``: no vision token in a response (engines
  on a VLM also never sample one: ``vision_token_ids`` are banned).

``vision_tokens(tokenizer)`` reads a tokenizer's vision tokens; the engines read them
from the model's config (``rollpipe.engines.images.vision_tokens_of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollpipe.engines.images import (
    ImageTokenError,
    VisionTokens,
    check_image_prompt,
    check_reported_prompt,
    check_response,
    collapse_image_pads,
    expand_image_pads,
    image_token_counts,
)

__all__ = [
    "ImageTokenError",
    "VisionTokens",
    "check_expanded_prompt",
    "check_image_prompt",
    "check_reported_prompt",
    "check_response",
    "collapse_image_pads",
    "expand_image_pads",
    "image_token_counts",
    "vision_token_ids",
    "vision_tokens",
]

NAMES = {
    "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
}
"""``VisionTokens`` field -> the Qwen2-VL token it is."""


def vision_tokens(tokenizer: Any) -> VisionTokens:
    """A tokenizer's vision tokens (Qwen2-VL's names, ``NAMES``); raises ``ValueError``
    if it has no ``<|image_pad|>``.

    Examples:
        >>> from transformers import AutoTokenizer
        >>> from rollpipe.training.tiny_vlm import default_vlm_path
        >>> tokens = vision_tokens(AutoTokenizer.from_pretrained(default_vlm_path()))
        >>> tokens.image_pad, tokens.banned
        (514, (512, 513, 514, 515))
    """
    vocab = tokenizer.get_vocab()
    ids = {field: vocab.get(name) for field, name in NAMES.items()}
    if ids["image_pad"] is None:
        raise ValueError(
            f"vision_tokens: the tokenizer has no {NAMES['image_pad']} token; a "
            "vision-language model's tokenizer (Qwen2-VL style) is needed"
        )
    return VisionTokens(**ids)  # type: ignore[arg-type]


def vision_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of a tokenizer's vision tokens, never to be sampled (what the engines ban).

    Examples:
        >>> from transformers import AutoTokenizer
        >>> from rollpipe.training.tiny_vlm import default_vlm_path
        >>> vision_token_ids(AutoTokenizer.from_pretrained(default_vlm_path()))
        (512, 513, 514, 515)
    """
    return vision_tokens(tokenizer).banned


def check_expanded_prompt(
    reported: Sequence[int] | None, expected: Sequence[int], where: str = "turn"
) -> None:
    """Raise ``ImageTokenError`` unless the engine's expanded prompt ``reported`` equals
    the locally expanded ``expected`` (``expand_image_pads``), naming the first
    difference and both lengths.

    Examples:
        >>> expected = expand_image_pads([1, 9, 2], [[1, 4, 4]], 2, 9)
        >>> check_expanded_prompt([1, 9, 9, 9, 9, 2], expected)
        >>> check_expanded_prompt([1, 9, 9, 9, 2], expected, "turn 2")
        Traceback (most recent call last):
        ...
        rollpipe.engines.images.ImageTokenError: turn 2: the engine's expanded prompt ...
    """
    if reported is None:
        raise ImageTokenError(
            f"{where}: the engine reported no expanded prompt (Generation.prompt_token_ids); "
            "use an engine that supports('images')"
        )
    if len(reported) == len(expected) and list(reported) == list(expected):
        return
    a, b = np.asarray(reported, dtype=np.int64), np.asarray(expected, dtype=np.int64)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    first = int(differ[0]) if len(differ) else n
    raise ImageTokenError(
        f"{where}: the engine's expanded prompt ({len(a)} ids) differs from the local "
        f"expansion ({len(b)} ids) from position {first} on; the prompt's image pads and "
        "the images sent do not match (one pad per image, all images so far, in order)"
    )
