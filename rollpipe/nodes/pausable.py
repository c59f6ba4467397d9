"""Pausable: the last stage, where a consumer asking for data meets the pipeline's suspension.

The suspension itself (state, mode, hold, who asked, waiters) is one ``Suspension``
(``suspension.py``), shared with the rollout's admission. ``Pausable.next()`` asks it
first (``Suspension.enter_batch``): a plain ``suspend()`` is resumed by the next request
from any thread (ROLL's ``suspend → update_weights → get_batch``); a held one makes the
request wait until ``resume()``, or raises on the thread that holds it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torchdata.nodes import BaseNode

from rollpipe.nodes.closing import close_chain
from rollpipe.nodes.suspension import Suspension
from rollpipe.runtime import RuntimeClosedError

T = TypeVar("T")


class Pausable(BaseNode[T]):
    """Pass-through node that asks ``suspension`` before each item (see the module doc).

    A wait on a held suspension runs on the engine's runtime (through this node's scope),
    so closing the node, the pipeline or the engine ends it at once with an error.

    Examples:
        >>> from torchdata.nodes import IterableWrapper
        >>> from rollpipe import ScriptedEngine
        >>> with ScriptedEngine(lambda *_: []) as scripted:
        ...     suspension = Suspension(scripted)
        ...     node = Pausable(IterableWrapper([1, 2, 3]), suspension)
        ...     first = next(node)
        ...     suspension.suspend()  # not held: the next item asked for resumes it
        ...     print(first, scripted.is_paused, next(node), scripted.is_paused)
        ...     node.close()
        1 True 2 False
    """

    def __init__(self, source: BaseNode[T], suspension: Suspension) -> None:
        super().__init__()
        if suspension.engine is None:
            raise ValueError("Pausable: the suspension needs an engine (its runtime runs waits)")
        self.source = source
        self.suspension = suspension
        self._scope = suspension.engine.runtime.scope("Pausable")

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}

    def next(self) -> T:
        self.suspension.enter_batch(self._scope.call)
        self._scope.check_open()
        return next(self.source)

    def close(self) -> None:
        """Wake a consumer waiting for ``resume()`` with an error, then close the chain."""
        self._scope.close(RuntimeClosedError("the pipeline was closed; build a new one to go on"))
        close_chain(self.source)
