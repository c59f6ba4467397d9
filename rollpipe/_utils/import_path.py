"""Objects named by import path, so a config names a function or a factory that resolves in
any process (a Ray actor included): ``"package.module:attr"``, and with ``dotted=True`` also
``"package.module.attr"`` (how ROLL writes class paths)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["NotAnImportPath", "import_object"]


class NotAnImportPath(ValueError):
    """The string has no module part or no attribute part."""


def import_object(path: str, *, dotted: bool = False) -> Any:
    """The object ``path`` names. Raises ``NotAnImportPath`` for a string of the wrong
    shape, else whatever importing the module or reading the attribute raised."""
    module_name, sep, attr = path.partition(":")
    if not sep and dotted:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise NotAnImportPath(path)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
