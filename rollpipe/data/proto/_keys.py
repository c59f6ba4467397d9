"""Where a DataProto key lives, and the old names of renamed columns.

A key asked of the wrong part (a non-tensor column of ``batch``, a tensor of
``non_tensor_batch``, a ``meta_info`` key as a column) fails with a KeyError that says
where it is. A renamed column (``docs/changes.md``) is still read under its old name,
with a DeprecationWarning naming the new one. ``non_tensor_batch`` is a
:class:`NonTensorColumns`, a dict that does both for ``[key]`` and ``.get(key)``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["RENAMED", "NonTensorColumns", "current_name", "missing_key"]

RENAMED = {"end_reason": "end_reasons"}  # old column name -> the one rows use

_PARTS = {
    "batch": "batch.batch (a tensor)",
    "non_tensor_batch": "batch.non_tensor_batch (one Python object per row)",
    "meta_info": "batch.meta_info (one value for the whole batch)",
}


def current_name(key: Any, present: Iterable[str]) -> Any:
    """``key``, or its new name when ``key`` is a renamed column's old name and the new
    one is ``present`` (with a DeprecationWarning)."""
    new = RENAMED.get(key) if isinstance(key, str) else None
    if new is None or new not in present:
        return key
    warnings.warn(
        f"the column {key!r} is now named {new!r}; read batch.non_tensor_batch[{new!r}]",
        DeprecationWarning,
        stacklevel=3,
    )
    return new


def missing_key(
    key: Any, asked: str, parts: Mapping[str, Iterable[str]], what: str | None = None
) -> KeyError:
    """The KeyError for ``key`` asked of part ``asked`` (``"batch"``, ``"non_tensor_batch"``,
    ``"meta_info"`` or ``"columns"``: either of the first two); ``parts`` maps each part
    to its keys; ``what`` names the key in the message (default: ``"<asked> key"``). It
    says where the key is when another part holds it, else lists the keys there are."""
    what = what or ("column" if asked == "columns" else f"{asked} key")
    for part, keys in parts.items():
        if part != asked and key in keys:
            return KeyError(
                f"{what} {key!r} not found: {key!r} is in {_PARTS[part]}, not "
                f"{_asked(asked)}; read it as batch.{part}[{key!r}]"
            )
    if asked == "columns":
        have = [*parts.get("batch", ()), *parts.get("non_tensor_batch", ())]
        said = f"no column {key!r}" if what == "column" else f"{what} {key!r} not found"
        return KeyError(f"{said}; columns are {have}")
    return KeyError(f"{what} {key!r} not found; {asked} keys are {list(parts[asked])}")


def _asked(asked: str) -> str:
    return "a column" if asked == "columns" else f"batch.{asked}"


class NonTensorColumns(dict[str, Any]):
    """``DataProto.non_tensor_batch``: a plain dict of columns, except that a missing key
    raises a KeyError saying where it is, and a renamed column's old name reads the
    column with a DeprecationWarning (``[key]`` and ``.get(key)``). ``in`` and iteration
    see only the real keys."""

    def __init__(self, columns: Mapping[str, Any], owner: Any = None) -> None:
        super().__init__(columns)
        self._owner = None if owner is None else weakref.ref(owner)

    def __missing__(self, key: Any) -> Any:
        new = current_name(key, self)
        if new is not key:
            return self[new]
        raise missing_key(key, "non_tensor_batch", self._parts())

    def get(self, key: Any, default: Any = None) -> Any:
        """The column ``key`` (an old name reads the renamed column), else ``default``."""
        if key in self:
            return self[key]
        new = current_name(key, self)
        return self[new] if new is not key else default

    def _parts(self) -> dict[str, Iterable[str]]:
        owner = None if self._owner is None else self._owner()
        batch = getattr(owner, "batch", None)
        return {
            "batch": list(batch.keys()) if batch is not None else [],
            "non_tensor_batch": list(self),
            "meta_info": list(getattr(owner, "meta_info", {})),
        }

    def __reduce__(self) -> Any:  # pickles as a plain dict (the owner is not pickled)
        return (dict, (dict(self),))
