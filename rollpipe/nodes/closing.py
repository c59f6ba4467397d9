"""close_chain: closing the last node of a chain closes every node before it.

torchdata 0.11's nodes have no ``close()``: a node's threads end with the node (``__del__``,
``reset``). rollpipe's nodes that own threads or a scope (``EpisodeRunner``, ``Pausable``) have a
``close()`` that releases them and then closes their own source. ``close_chain`` walks a
chain from its last node: it closes a node that has ``close()``, and steps through one
that has none (``Mapper``, ``Collate``, a user's node) to the nodes it reads from.
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

__all__ = ["close_chain"]


def close_chain(node: Any) -> None:
    """Close ``node`` and, through it, every node it reads from (each at most once)."""
    _close(node, set())


def _close(node: Any, seen: set[int]) -> None:
    if id(node) in seen:
        return
    seen.add(id(node))
    close = getattr(type(node), "close", None)  # a node's own close() closes its sources
    if callable(close):
        node.close()
        return
    for value in vars(node).values() if hasattr(node, "__dict__") else ():
        if isinstance(value, BaseNode):
            _close(value, seen)
