"""Images at the front door: OpenAI's ``image_url`` content parts, decoded.

A user message may hold ``{"type": "image_url", "image_url": {"url": "data:image/png;
base64,..."}}`` parts beside its text parts, as the OpenAI API takes them. The door reads
``data:`` URLs only (base64, any format PIL opens) and fetches nothing: an ``http(s)``
URL is refused with the part named. Each image becomes an RGB ``PIL.Image``, the image
of a rollpipe content part (``rollpipe.agent.content``), which the session's image
conversation renders.

Examples:
    >>> import base64, io
    >>> from PIL import Image
    >>> png = io.BytesIO(); Image.new("RGB", (4, 3), "red").save(png, "PNG")
    >>> url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    >>> decode_image_part({"type": "image_url", "image_url": {"url": url}}, "part").size
    (4, 3)
    >>> decode_image_part({"type": "image_url", "image_url": {"url": "https://x/a.png"}}, "p")
    Traceback (most recent call last):
    rollpipe.frontdoor.images.ImagePartError: p.image_url.url is a remote URL ...
"""

from __future__ import annotations

import base64
import binascii
import io
import reprlib
from collections.abc import Mapping
from typing import Any

__all__ = ["ImagePartError", "decode_image_part", "image_parts"]


class ImagePartError(ValueError):
    """An ``image_url`` part the door cannot read; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def decode_image_part(part: Mapping[str, Any], where: str) -> Any:
    """The RGB ``PIL.Image`` of an ``image_url`` part whose url is a base64 ``data:``
    URL; :class:`ImagePartError` naming ``where`` otherwise."""
    at = f"{where}.image_url.url"
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, Mapping) else None
    if not isinstance(url, str):
        raise ImagePartError(
            f"{where} must be {{'type': 'image_url', 'image_url': {{'url': "
            "'data:image/png;base64,...'}}}",
            at,
        )
    if url.startswith(("http://", "https://")):
        raise ImagePartError(
            f"{at} is a remote URL ({reprlib.repr(url)}); the server fetches nothing: send "
            "the image inline as a data URL (data:image/png;base64,...)",
            at,
        )
    head, comma, data = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64") or not comma:
        raise ImagePartError(
            f"{at} must be a base64 data URL of an image (data:image/png;base64,...), got "
            f"{reprlib.repr(url)}",
            at,
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImagePartError(f"{at}: the base64 data does not decode: {exc}", at) from exc
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as opened:
            image = opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImagePartError(
            f"{at}: the data is not an image PIL can read ({len(raw)} bytes, declared "
            f"{head[5:-7]}): {exc}",
            at,
        ) from exc
    return image


def image_parts(messages: Any) -> list[str]:
    """Where the image parts of normalised ``messages`` are (``messages[i].content[j]``)."""
    return [
        f"messages[{i}].content[{j}]"
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), list)
        for j, p in enumerate(m["content"])
        if p.get("type") == "image"
    ]
