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
    rollpipe.agent.content.ContentError: observation[0]['image'] is a numpy array of shape (4, 4)
    and dtype uint8; an image is a PIL.Image.Image or an H x W x 3 uint8 numpy array (RGB)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollpipe.agent.content import (
    PART_TYPES,
    ContentError,
    ContentPart,
    check_image,
    check_parts,
    image_size,
    is_image,
    part_text,
)

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
                    part_text(p) for p in check_parts(content, f"observation[{i}]['content']")
                )
            lines.append(head + content)
        return "\n".join(lines)
    return "\n".join(part_text(p) for p in check_parts(observation))
