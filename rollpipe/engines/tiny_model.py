"""Moved: the built-in tiny model now lives in :mod:`rollpipe.training.tiny_model` (it is
demo and training material, not part of the rollout core).

This old path still imports: ``from rollpipe.engines.tiny_model import default_model_path``
looks each name up in the new module on first access, so importing ``rollpipe.engines``
(or this module) never loads ``rollpipe.training``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollpipe.training.tiny_model import (
        CHAT_TEMPLATE,
        EOS_TOKEN,
        PAD_TOKEN,
        SPECIAL_TOKENS,
        TOOL_TOKENS,
        TOOLS_CHAT_TEMPLATE,
        build_tiny_model,
        default_model_path,
    )

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "TOOLS_CHAT_TEMPLATE",
    "TOOL_TOKENS",
    "build_tiny_model",
    "default_model_path",
]


def __getattr__(name: str) -> Any:
    """``name`` from :mod:`rollpipe.training.tiny_model`, imported on first use."""
    if not (name.startswith("__") and name.endswith("__")):
        from rollpipe.training import tiny_model

        try:
            return getattr(tiny_model, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
