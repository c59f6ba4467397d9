"""Content parts: observations that mix text and images, checked, listed and logged.

A content part is an OpenAI-style dict: ``{"type": "text", "text": str}`` or
``{"type": "image", "image": img}``, where ``img`` is a ``PIL.Image.Image`` or an
``H x W x 3`` ``uint8`` numpy array (RGB). An env with images answers like a chat env,
with a list of messages whose ``content`` is a list of parts::

    [{"role": "user", "content": [{"type": "text", "text": "..."},
                                  {"type": "image", "image": <PIL.Image.Image>}]}]

(the visual grid envs, :mod:`rollpipe.envs.visual_envs`, return exactly that). The helpers
here take any observation an env may return: a str, a list of parts, or a list of
messages whose contents are strs or lists of parts. :func:`check_parts` refuses anything
else with a ``ContentError`` naming the part and what is accepted; :func:`image_parts`
lists the images in order; :func:`text_of_parts` gives the text for logs, an image shown
as ``<image WxH>``.

Examples:
    >>> import numpy as np
    >>> parts = [{"type": "text", "text": "Where next?"},
    ...          {"type": "image", "image": np.zeros((48, 64, 3), dtype=np.uint8)}]
    >>> text_of_parts(parts)
    'Where next?\\n<image 64x48>'
    >>> [image_size(im) for im in image_parts([{"role": "user", "content": parts}])]
    [(64, 48)]
    >>> check_parts([{"type": "image", "image": np.zeros((4, 4), dtype=np.uint8)}])
    Traceback (most recent call last):
    ...
    rollpipe.envs.content.ContentError: observation[0]['image'] is a numpy array of shape (4, 4)
    and dtype uint8; an image is a PIL.Image.Image or an H x W x 3 uint8 numpy array (RGB)
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
    "image_parts",
    "image_size",
    "is_image",
    "parts_of",
    "text_of_parts",
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
        rollpipe.envs.content.ContentError: Lake.step: observation[0]['type'] is 'audio';
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


def _is_messages(observation: Any) -> bool:
    """Whether ``observation`` is a non-empty list of messages (dicts with a ``role``)."""
    return (
        isinstance(observation, Sequence)
        and not isinstance(observation, (str, bytes))
        and bool(observation)
        and all(isinstance(m, Mapping) and "role" in m for m in observation)
    )


def parts_of(observation: Any, where: str = "observation") -> list[ContentPart]:
    """Every content part of ``observation`` in order: a str is one text part, a list of
    parts is checked, a list of messages gives its contents' parts (a str content is one
    text part). Anything else raises ``ContentError`` naming ``where``."""
    if isinstance(observation, str):
        return [{"type": "text", "text": observation}]
    if _is_messages(observation):
        out: list[ContentPart] = []
        for i, message in enumerate(observation):
            content = message.get("content")
            at = f"{where}[{i}]['content']"
            if isinstance(content, str):
                out.append({"type": "text", "text": content})
            else:
                out.extend(check_parts(content, at))
        return out
    return check_parts(observation, where)


def image_parts(observation: Any) -> list[Any]:
    """The images of ``observation`` (parts or messages, see :func:`parts_of`), in order.

    Examples:
        >>> image_parts("text only")
        []
    """
    return [p["image"] for p in parts_of(observation) if p["type"] == "image"]


def _part_text(part: ContentPart) -> str:
    if part["type"] == "text":
        return str(part["text"])
    width, height = image_size(part["image"])
    return f"<image {width}x{height}>"


def text_of_parts(observation: Any) -> str:
    """``observation`` as one string for logs: text parts as they are, each image as
    ``<image WxH>``, parts joined by newlines; a message list's messages joined by
    newlines, a tool result prefixed ``[tool NAME]`` (as ``messages_text``).

    Examples:
        >>> text_of_parts([{"role": "tool", "name": "look", "content": "a lake"}])
        '[tool look] a lake'
    """
    if isinstance(observation, str):
        return observation
    if _is_messages(observation):
        lines = []
        for i, m in enumerate(observation):
            head = f"[{m['role']} {m['name']}] " if m["role"] == "tool" and m.get("name") else ""
            content = m.get("content")
            if not isinstance(content, str):
                content = "\n".join(
                    _part_text(p) for p in check_parts(content, f"observation[{i}]['content']")
                )
            lines.append(head + content)
        return "\n".join(lines)
    return "\n".join(_part_text(p) for p in check_parts(observation))
