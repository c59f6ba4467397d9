"""Pausable: suspend collection while the trainer updates the weights, lose nothing.

``suspend(mode)`` closes the admission gate (no new episodes, no new engine requests)
and pauses the engine:

* ``"keep"``  — in-flight requests freeze and continue after ``resume()``;
* ``"abort"`` — in-flight requests end early and their turn is regenerated on resume;
* ``"wait"``  — in-flight requests run to completion first (drain).

Then ``update_weights(...)`` loads new weights and bumps the policy version, and
``resume()`` reopens. Every episode either finishes or is still in flight: none is
dropped or started twice.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Literal, TypeVar

from torchdata.nodes import BaseNode

from rollpipe.engines.base import Engine
from rollpipe.nodes.signals import RolloutControl

T = TypeVar("T")
PauseMode = Literal["keep", "abort", "wait"]


class PauseController:
    """Suspends and resumes one engine and the admission gate of the stages using it."""

    def __init__(self, engine: Engine, control: RolloutControl) -> None:
        self.engine = engine
        self.control = control
        self._suspended_by: int | None = None  # thread id, None when running
        self._resumed = threading.Event()
        self._resumed.set()

    @property
    def is_suspended(self) -> bool:
        return self._suspended_by is not None

    @property
    def suspended_by_this_thread(self) -> bool:
        return self._suspended_by == threading.get_ident()

    def suspend(self, mode: PauseMode = "keep") -> None:
        """Close admission and pause the engine (see the module doc for ``mode``)."""
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"suspend: mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        if self.is_suspended:
            return
        self._resumed.clear()
        self._suspended_by = threading.get_ident()
        self.control.close()
        self.engine.pause(mode)

    def resume(self) -> None:
        """Resume the engine and reopen admission. A no-op when not suspended."""
        if not self.is_suspended:
            return
        self.engine.resume()
        self.control.open()
        self._suspended_by = None
        self._resumed.set()

    def update_weights(self, weights: Any, version: int | None = None) -> int:
        """Load ``weights`` into the engine; returns the new policy version.

        Call between ``suspend()`` and ``resume()`` for on-policy data (ROLL's
        suspend → model_update → resume).
        """
        return self.engine.update_weights(weights, version=version)

    def wait_resumed(self, timeout: float | None = None) -> bool:
        return self._resumed.wait(timeout)

    @contextlib.contextmanager
    def suspended(self, mode: PauseMode = "keep") -> Iterator[PauseController]:
        """``with controller.suspended(): controller.update_weights(model)``."""
        self.suspend(mode)
        try:
            yield self
        finally:
            self.resume()


class Pausable(BaseNode[T]):
    """Pass-through node that holds its consumer while the pipeline is suspended.

    Asking for data from the thread that suspended would wait forever, so it raises
    instead; another thread's request waits until ``resume()``.
    """

    def __init__(self, source: BaseNode[T], controller: PauseController) -> None:
        super().__init__()
        self.source = source
        self.controller = controller

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}

    def next(self) -> T:
        if self.controller.is_suspended:
            if self.controller.suspended_by_this_thread:
                raise RuntimeError(
                    "the pipeline is suspended: call resume() before asking for the next batch"
                )
            self.controller.wait_resumed()
        return next(self.source)
