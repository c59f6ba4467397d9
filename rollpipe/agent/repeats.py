"""Repeats: chat-turn work kept by its whole input, so a repeated turn is not done again.

The episodes of a group start from the same task, and their turns often repeat one
another: the same response parsed at the same turn (call ids derive from the turn), the
same tool results rendered after the same window. Rendering a window with the chat
template and tokenizing it is most of a tool turn's CPU, and it is a pure function of
the messages, the response ids and the tools; :class:`Repeats` keeps such results under
a key made of **all** of that input (each message frozen whole, every value with its
type, so ``1`` and ``True`` differ), so a hit is exactly what the work would give. The
text conversation does the same per observation (``ChatFormat``'s prompt caches).

A store holds at most ``size`` entries and is emptied when full (no order kept: a dict
is safe to share between the loop and an episode's env thread rendering off it).

Examples:
    >>> repeats = Repeats(size=2)
    >>> hi = frozen_message({"role": "user", "content": "hi"})
    >>> key = repeat_key("tools", [hi], [], (1, 2))
    >>> repeats.get(key) is None
    True
    >>> repeats.put(key, ((3, 4), False))
    >>> again = frozen_message({"role": "user", "content": "hi"})
    >>> repeats.get(repeat_key("tools", [again], [], (1, 2)))
    ((3, 4), False)
    >>> frozen_message({"n": 1}) == frozen_message({"n": True})
    False
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from rollpipe.agent.tools import ToolSet, schemas_key

__all__ = ["REPEATS_SIZE", "Repeats", "frozen_message", "repeat_key", "tools_key"]

REPEATS_SIZE = 4096


class Repeats:
    """A bounded store of exact results by their whole input (see the module doc)."""

    def __init__(self, size: int = REPEATS_SIZE) -> None:
        self.size = size
        self._store: dict[Hashable, Any] = {}
        self._numbers: dict[Hashable, int] = {}
        self._next = itertools.count(1)

    def number(self, frozen: Hashable) -> int:
        """A number for a frozen message: equal messages get equal numbers, and a number
        is never given to another message (numbers are not reused when the store is
        emptied), so keys of numbers are exact and cheap to hash."""
        found = self._numbers.get(frozen)
        if found is None:
            if len(self._numbers) >= self.size:
                self._numbers.clear()
            found = self._numbers[frozen] = next(self._next)
        return found

    def get(self, key: Hashable) -> Any:
        """The result kept under ``key``, or None."""
        return self._store.get(key)

    def put(self, key: Hashable, value: Any) -> None:
        """Keep ``value`` under ``key`` (the store is emptied first when full)."""
        if len(self._store) >= self.size:
            self._store.clear()
        self._store[key] = value


def tools_key(tools: Any) -> str:
    """The key of a tool set: its schemas as sorted JSON (equal schemas, equal keys; a
    :class:`ToolSet`'s made once)."""
    if isinstance(tools, ToolSet):
        return tools.key
    return schemas_key(list(getattr(tools, "schemas", tools)))


def repeat_key(
    tools: str,
    window: Sequence[Hashable],
    new: Sequence[Hashable],
    response_ids: Sequence[int],
) -> Hashable | None:
    """The key of a continuation: the tools, every message rendered (each as
    :func:`frozen_message` gives it) and the response's ids; None when a message could
    not be frozen (an image: such turns are not kept)."""
    if None in window or None in new:
        return None
    return (tools, tuple(window), tuple(new), tuple(response_ids))


def frozen_message(message: Mapping[str, Any]) -> Hashable:
    """``message`` frozen whole (``TypeError`` for a value that cannot be, e.g. an image)."""
    return _frozen(message)


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable value that equals another's only when both are equal and
    of the same types throughout (a dict's keys in their order, which a template sees)."""
    kind = type(value)
    if kind is str:
        return value  # type: ignore[no-any-return]
    if kind is dict or isinstance(value, Mapping):
        return (kind, *[(k, v if type(v) is str else _frozen(v)) for k, v in value.items()])
    if kind is list or kind is tuple:
        return (kind, *map(_frozen, value))
    if value is None or kind is int or kind is float or kind is bool:
        return (kind, value)
    raise TypeError(f"not frozen: {kind.__name__}")
