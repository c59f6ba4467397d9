"""RowText: a dialog's row as text, by the messages each piece of it covers.

A dialog's row is its first prompt, then each turn's response and continuation. Its text
is kept in those pieces, each held with the messages it renders (and the generation
prompt after them), keyed by the first one's id: a window of the conversation then
finds the row's own text of its messages without rendering them (``Dialog``: where the
window's render with the new messages starts with it and the response, the rest is the
continuation). Pieces are checked by identity against the messages asked about, so a
copy's pieces (a front door trial that shares the record) never stand for other messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RowText"]

Message = Mapping[str, Any]


class RowText:
    """The row's text pieces of one dialog (see the module doc)."""

    def __init__(self) -> None:
        self._pieces: dict[int, tuple[tuple[Message, ...], str]] = {}

    def add(self, messages: Sequence[Message], text: str) -> None:
        """``text`` is the row's text of ``messages`` and the generation prompt after them."""
        self._pieces[id(messages[0])] = (tuple(messages), text)

    def of(self, messages: Sequence[Message], start: int, end: int) -> str | None:
        """The row's text of ``messages[start:end]`` and the generation prompt after them;
        None where the row's pieces do not start at ``start`` and end at ``end``."""
        parts, at = [], start
        while at < end:
            found = self._pieces.get(id(messages[at]))
            if found is None or at + len(found[0]) > end:
                return None
            covered, text = found
            if any(
                a is not b for a, b in zip(covered, messages[at : at + len(covered)], strict=True)
            ):
                return None
            at += len(covered)
            parts.append(text)
        return "".join(parts)
