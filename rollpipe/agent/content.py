"""Content parts: the pieces of a chat message that mixes text and images, checked.

A content part is an OpenAI-style dict: ``{"type": "text", "text": str}`` or
``{"type": "image", "image": img}``, where ``img`` is a ``PIL.Image.Image`` or an
``H x W x 3`` ``uint8`` numpy array (RGB). An env's user message may hold a list of them
as its ``content`` (``rollpipe.agent.env_returns.check_messages``); the episode checks
them here, where it uses them (``rollpipe.envs.content`` re-exports these checks and adds
the helpers that walk whole observations).

Examples:
    >>> import numpy as np
    >>> check_parts([{"type": "text", "text": "hi"}])
    [{'type': 'text', 'text': 'hi'}]
    >>> part_text({"type": "image", "image": np.zeros((48, 64, 3), dtype=np.uint8)})
    '<image 64x48>'
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "PART_TYPES",
    "ContentError",
    "ContentPart",
    "check_image",
    "check_parts",
    "image_size",
    "is_image",
    "part_text",
]

ContentPart = dict[str, Any]
"""``{"type": "text", "text": str}`` or ``{"type": "image", "image": PIL image | array}``."""

PART_TYPES = ("text", "image")
_IMAGE_RULE = "an image is a PIL.Image.Image or an H x W x 3 uint8 numpy array (RGB)"
_PART_RULE = (
    "a content part is {'type': 'text', 'text': str} or {'type': 'image', 'image': img}, "
    f"where {_IMAGE_RULE}"
)


class ContentError(ValueError):
    """A content part (or the observation holding it) is not one rollpipe accepts."""


def _is_pil(value: object) -> bool:
    """Whether ``value`` is a PIL image, without importing PIL when it is not loaded."""
    return any(
        cls.__module__.startswith("PIL.") and cls.__name__ == "Image" for cls in type(value).__mro__
    )


def is_image(value: object) -> bool:
    """Whether ``value`` is an image a part may hold (a PIL image, or an H x W x 3 uint8
    array with H, W >= 1)."""
    if _is_pil(value):
        return True
    return (
        isinstance(value, np.ndarray)
        and value.dtype == np.uint8
        and value.ndim == 3
        and value.shape[2] == 3
        and value.shape[0] >= 1
        and value.shape[1] >= 1
    )


def check_image(where: str, value: object) -> None:
    """Raise ``ContentError`` naming ``where`` unless ``value`` is an accepted image."""
    if is_image(value):
        return
    if isinstance(value, np.ndarray):
        got = f"a numpy array of shape {value.shape} and dtype {value.dtype}"
    else:
        got = f"{type(value).__name__} {reprlib.repr(value)}"
    raise ContentError(f"{where} is {got}; {_IMAGE_RULE}")


def image_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of an accepted image (PIL's ``size`` order).

    Examples:
        >>> image_size(np.zeros((48, 64, 3), dtype=np.uint8))
        (64, 48)
    """
    check_image("image", image)
    if isinstance(image, np.ndarray):
        return int(image.shape[1]), int(image.shape[0])
    width, height = image.size
    return int(width), int(height)


def check_parts(parts: Any, where: str = "observation") -> list[ContentPart]:
    """``parts`` (a non-empty list of content parts) as checked plain dicts; a
    ``ContentError`` naming ``where``, the index and the field otherwise.

    Examples:
        >>> check_parts([{"type": "text", "text": "hi"}])
        [{'type': 'text', 'text': 'hi'}]
        >>> check_parts([{"type": "audio", "audio": b""}], "Lake.step: observation")
        Traceback (most recent call last):
        ...
        rollpipe.agent.content.ContentError: Lake.step: observation[0]['type'] is 'audio';
        a content part is {'type': 'text', 'text': str} or {'type': 'image', 'image': img}, ...
    """
    if not isinstance(parts, Sequence) or isinstance(parts, (str, bytes)) or not parts:
        raise ContentError(
            f"{where} must be a non-empty list of content parts, got "
            f"{type(parts).__name__} {reprlib.repr(parts)}; {_PART_RULE}"
        )
    out: list[ContentPart] = []
    for i, part in enumerate(parts):
        at = f"{where}[{i}]"
        if not isinstance(part, Mapping):
            raise ContentError(f"{at} is {type(part).__name__}, not a dict; {_PART_RULE}")
        kind = part.get("type")
        if kind not in PART_TYPES:
            raise ContentError(f"{at}['type'] is {kind!r}; {_PART_RULE}")
        unknown = sorted(set(part) - {"type", kind})
        if unknown:
            raise ContentError(f"{at} (a {kind!r} part) has unknown keys {unknown}; {_PART_RULE}")
        if kind not in part:
            raise ContentError(f"{at} (a {kind!r} part) has no {kind!r} key; {_PART_RULE}")
        value = part[kind]
        if kind == "text" and not isinstance(value, str):
            raise ContentError(f"{at}['text'] must be a str, got {type(value).__name__}")
        if kind == "image":
            check_image(f"{at}['image']", value)
        out.append({"type": kind, kind: value})
    return out


def part_text(part: ContentPart) -> str:
    """A checked part as log text: its text, or ``<image WxH>`` for an image."""
    if part["type"] == "text":
        return str(part["text"])
    width, height = image_size(part["image"])
    return f"<image {width}x{height}>"
