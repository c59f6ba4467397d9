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
from typing import Any, TypeVar

from torchdata.nodes import BaseNode

from rollpipe.engines.protocol import PAUSE_MODES, Engine, PauseMode
from rollpipe.nodes.closing import close_chain
from rollpipe.nodes.signals import RolloutControl
from rollpipe.runtime import Gate, RuntimeClosedError

T = TypeVar("T")


class PauseController:
    """Suspends and resumes one engine and the admission gate of the stages using it.

    The one place that knows whether the pipeline is suspended: ``resumed`` is open
    while it runs and closed while it is suspended.
    """

    def __init__(self, engine: Engine, control: RolloutControl) -> None:
        self.engine = engine
        self.control = control
        self.resumed = Gate(is_open=True)
        self._lock = threading.Lock()
        self._suspended_by: int | None = None  # thread id, None when running

    @property
    def is_suspended(self) -> bool:
        return self._suspended_by is not None

    @property
    def suspended_by_this_thread(self) -> bool:
        return self._suspended_by == threading.get_ident()

    def suspend(self, mode: PauseMode = "keep") -> None:
        """Close admission and pause the engine (see the module doc for ``mode``).

        If the engine cannot pause (closed, dead), admission reopens, the error is raised
        and the pipeline is not marked suspended.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"suspend: mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        with self._lock:
            if self.is_suspended:
                return
            self.control.close()
            try:
                self.engine.pause(mode)
            except BaseException:
                self.control.open()
                raise
            self._suspended_by = threading.get_ident()
            self.resumed.close()

    def resume(self) -> None:
        """Resume the engine and reopen admission. A no-op when not suspended.

        The pipeline counts as resumed even when the engine cannot resume (it was closed
        meanwhile); that error is raised after admission reopened.
        """
        with self._lock:
            if not self.is_suspended:
                return
            try:
                self.engine.resume()
            finally:
                self.control.open()
                self._suspended_by = None
                self.resumed.open()

    def update_weights(self, weights: Any, version: int | None = None) -> int:
        """Load ``weights`` into the engine; returns the new policy version.

        Call between ``suspend()`` and ``resume()`` for on-policy data (ROLL's
        suspend → model_update → resume).
        """
        return self.engine.update_weights(weights, version=version)

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
    instead; another thread's request waits until ``resume()`` — or until the pipeline or
    the engine is closed, which wakes it with an error. The wait runs on the engine's
    runtime (through this node's scope), so closing either ends it at once.
    """

    def __init__(self, source: BaseNode[T], controller: PauseController) -> None:
        super().__init__()
        self.source = source
        self.controller = controller
        self._scope = controller.engine.runtime.scope("Pausable")

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
            self._scope.call(self.controller.resumed.wait_async())
        self._scope.check_open()
        return next(self.source)

    def close(self) -> None:
        """Wake a consumer waiting for ``resume()`` with an error, then close the chain."""
        self._scope.close(RuntimeClosedError("the pipeline was closed; build a new one to go on"))
        close_chain(self.source)
