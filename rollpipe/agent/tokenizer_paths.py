"""Shortcuts between ChatFormat and the tokenizer, each giving exactly what the general
path gives: the Rust tokenizer's own ``encode`` / ``decode`` where transformers' wrappers
would return the same, prompt pieces packed once, tool-call arguments as templates take
them."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Packed", "fast_decoder", "fast_encoder", "packed", "template_message"]

Packed = tuple[tuple[int, ...], "npt.NDArray[np.int64]"]


def packed(ids: tuple[int, ...]) -> Packed:
    """``ids`` with the same ids as a read-only int64 array."""
    array = np.fromiter(ids, np.int64, len(ids))
    array.flags.writeable = False
    return ids, array


def fast_encoder(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """The Rust tokenizer's own ``encode`` (no special tokens added, special-token markup
    recognised) where transformers' ``__call__`` would give the same ids: a
    tokenizers-backed tokenizer with transformers' own ``__call__`` and ``_encode_plus``
    that does not split special tokens; None otherwise. It skips the argument handling
    of ``__call__`` (about 40% of encoding a short suffix)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its __call__, as it is
        return None
    cls = type(tokenizer)
    same = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.__call__ is PreTrainedTokenizerBase.__call__
        and cls._encode_plus is TokenizersBackend._encode_plus
        and getattr(tokenizer, "split_special_tokens", False) is False
    )
    backend = getattr(tokenizer, "_tokenizer", None)
    if not same or backend is None:
        return None

    def encode(text: str) -> list[int]:
        if backend.encode_special_tokens:  # what transformers' _encode_plus resets too
            backend.encode_special_tokens = False
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        return ids

    return encode


def template_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """``message`` with its tool calls' ``arguments`` as a dict, as chat templates take
    them (and as vLLM's renderer passes them): OpenAI messages carry them as JSON text,
    which many templates reject and others render double-encoded."""
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if isinstance(function, Mapping) and isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        out.append(call)
    return {**message, "tool_calls": out}


def fast_decoder(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own ``decode`` where transformers' ``decode`` would return
    its text unchanged (a tokenizers-backed tokenizer, transformers' own ``decode`` and
    ``_decode``, no clean-up of spaces); None otherwise."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its decode, as it is
        return None
    cls = type(tokenizer)
    same = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    )
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend.decode if same and backend is not None else None
