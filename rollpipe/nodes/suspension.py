"""Suspension: the one object that knows whether a pipeline is suspended, how, and for whom.

ROLL's loop suspends the rollout, updates the weights and asks for the next batch, which
resumes it: ``suspend() → update_weights() → get_batch()``. A ``Suspension`` holds that
state (running, suspended or closed), the pause ``mode`` (ROLL's ``"abort"`` by default),
whether the suspension is *held* (``suspend(hold=True)`` / ``with suspended():``: only
``resume()`` ends it), who asked (a thread name, for messages only) and since when. Its
one ``Gate`` is open while running: the rollout awaits it before every engine request
(admission), and a consumer waits on it while a hold lasts.

* ``suspend(mode)``: admission closes, then ``engine.pause(mode)``. The next batch asked
  for, from any thread, resumes it (``enter_batch``). A second ``suspend`` with the same
  mode is a no-op; with another mode it raises ``ValueError`` (``resume()`` first).
* ``suspend(mode, hold=True)``: the same, but a batch asked for waits until ``resume()``
  (and raises at once on the holding thread, which would wait for itself).
* ``close(reason)``: resumes the engine if suspended, then refuses every later control
  call with ``RuntimeClosedError``: nothing acts on the engine after a close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Literal

from rollpipe.engines.protocol import PAUSE_MODES, Engine, PauseMode, WeightsLike
from rollpipe.runtime import Gate, Listeners, RuntimeClosedError

__all__ = ["DEFAULT_MODE", "Suspension", "SuspensionState"]

_log = logging.getLogger(__name__)

SuspensionState = Literal["running", "suspended", "closed"]
DEFAULT_MODE: PauseMode = "abort"
"""ROLL's suspend: abort in-flight requests (their turns are regenerated after resume)."""


class Suspension:
    """Suspends and resumes one engine and the admission of the stages that use it.

    Args:
        engine: the engine to pause; None admits or holds episodes only (a stage used
            alone, in tests).
        name: names the pipeline in messages and errors.
        log_after_s: a batch waiting on a held suspension logs one line after this long.

    >>> suspension = Suspension(name="demo")
    >>> suspension.suspend()
    >>> suspension.state, suspension.mode, suspension.held
    ('suspended', 'abort', False)
    >>> suspension.enter_batch(lambda wait: None)  # the next batch resumes it
    >>> suspension.state
    'running'
    """

    def __init__(
        self, engine: Engine | None = None, *, name: str = "pipeline", log_after_s: float = 5.0
    ) -> None:
        self.engine = engine
        self.name = name
        self.log_after_s = log_after_s
        self._gate = Gate(is_open=True)  # open while running: admission and held waits
        self._lock = threading.Lock()
        self._mode: PauseMode | None = None
        self._held = False
        self._holder: int | None = None  # thread ident of a hold: guards self-deadlock only
        self._asked_by: str | None = None
        self._since: float | None = None
        self._closed: str | None = None
        self._listeners = Listeners()
        self._scope = None if engine is None else engine.runtime.scope(f"{name}: suspension")

    # -- state -----------------------------------------------------------------------
    @property
    def state(self) -> SuspensionState:
        if self._closed is not None:
            return "closed"
        return "running" if self._mode is None else "suspended"

    @property
    def is_suspended(self) -> bool:
        return self._mode is not None

    @property
    def mode(self) -> PauseMode | None:
        """The pause mode while suspended, else None."""
        return self._mode

    @property
    def held(self) -> bool:
        """Whether only ``resume()`` ends this suspension (not the next batch asked for)."""
        return self._held

    @property
    def asked_by(self) -> str | None:
        """The name of the thread that suspended (for messages; no rule reads it)."""
        return self._asked_by

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def describe(self) -> str:
        """One line for messages: the state, the mode, who asked and since when."""
        if self._closed is not None:
            return f"{self.name} is closed ({self._closed})"
        if self._mode is None:
            return f"{self.name} is running"
        since = time.strftime("%H:%M:%S", time.localtime(self._since or 0.0))
        how = "suspended and held" if self._held else "suspended"
        who = f"thread {self._asked_by!r}"
        return f"{self.name} is {how} (mode {self._mode!r}) by {who} since {since}"

    # -- admission -------------------------------------------------------------------
    @property
    def admitting(self) -> bool:
        """Whether new episodes and new engine requests may start (not suspended)."""
        return self._gate.is_open

    async def admit(self) -> None:
        """Return once admitting; the rollout awaits it before every engine request."""
        await self._gate.wait_async()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of state (cheap and thread-safe)."""
        self._listeners.add(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.remove(listener)

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the lock for a change; tell the listeners afterwards, even if it raised."""
        try:
            with self._lock:
                yield
        finally:
            self._notify()

    def _notify(self) -> None:
        self._listeners.notify()

    # -- control ---------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        if self._closed is not None:
            raise RuntimeClosedError(
                f"{call} on {self.name}, which is closed ({self._closed}): it no longer "
                "acts on its engine; build a new pipeline"
            )

    def suspend(self, mode: PauseMode = DEFAULT_MODE, *, hold: bool = False) -> None:
        """Close admission and pause the engine (see the module doc for ``hold``).

        Already suspended: the same mode is a no-op (``hold=True`` makes it held); another
        mode raises ``ValueError``. If the engine cannot pause (closed, dead), admission
        reopens, the error is raised and nothing counts as suspended.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"suspend: mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        me = threading.current_thread()
        with self._changing():
            self._check_open(f"suspend({mode!r})")
            if self._mode is not None:
                if mode != self._mode:
                    raise ValueError(
                        f"suspend({mode!r}): {self.describe()}; a suspension has one mode "
                        f"(requests already paused as {self._mode!r} cannot change): call "
                        "resume() first"
                    )
                if hold and not self._held:
                    self._held, self._holder, self._asked_by = True, me.ident, me.name
                return
            self._gate.close()
            try:
                if self.engine is not None:
                    self.engine.pause(mode)
            except BaseException:
                self._gate.open()
                raise
            self._mode, self._held = mode, hold
            self._holder = me.ident if hold else None
            self._asked_by, self._since = me.name, time.time()

    def resume(self) -> None:
        """Resume the engine and reopen admission; a no-op when not suspended.

        The suspension ends even when the engine cannot resume (it was closed meanwhile);
        that error is raised after admission reopened.
        """
        with self._changing():
            self._check_open("resume()")
            self._resume_locked()

    def _resume_locked(self) -> None:
        if self._mode is None:
            return
        try:
            if self.engine is not None:
                self.engine.resume()
        finally:
            self._mode, self._held, self._holder = None, False, None
            self._asked_by = self._since = None
            self._gate.open()

    def update_weights(self, weights: WeightsLike, version: int | None = None) -> int:
        """Load ``weights`` into the engine; returns the new policy version.

        Call it between ``suspend()`` and the next batch (or ``resume()``) for on-policy
        data, as ROLL's suspend → model_update → get_batch.
        """
        self._check_open("update_weights()")
        if self.engine is None:
            raise TypeError(f"update_weights: {self.name} has no engine")
        return self.engine.update_weights(weights, version=version)

    @contextlib.contextmanager
    def suspended(self, mode: PauseMode = DEFAULT_MODE) -> Iterator[Suspension]:
        """A held suspension for the block: ``with s.suspended(): s.update_weights(m)``."""
        self.suspend(mode, hold=True)
        try:
            yield self
        finally:
            if self._closed is None:  # closed in the block: close() resumed already
                self.resume()

    def close(self, reason: str = "closed") -> None:
        """Resume if suspended (an engine that cannot resume is ignored), then refuse
        every later ``suspend`` / ``resume`` / ``update_weights``; wakes waiting batches,
        which raise ``RuntimeClosedError`` with ``reason``. Idempotent."""
        with self._changing():
            if self._closed is not None:
                return
            self._closed = reason
            with contextlib.suppress(Exception):
                self._resume_locked()
        if self._scope is not None:
            self._scope.close(RuntimeClosedError(f"{self.name} was closed ({reason})"))

    # -- the consumer ----------------------------------------------------------------
    def enter_batch(self, wait: Callable[[Coroutine[Any, Any, None]], None] | None = None) -> None:
        """Called as a batch is asked for. Running: returns. Suspended, not held: resumes
        (ROLL's get_batch), whatever thread asks. Held: raises on the holding thread
        (it would wait for itself); elsewhere waits until ``resume()``, logging once after
        ``log_after_s``, and raises ``RuntimeClosedError`` if closed meanwhile. The wait
        runs on the engine's runtime through ``wait`` (a scope's ``call``; default: this
        suspension's own scope), so closing that scope ends it."""
        if wait is None:
            if self._scope is None:
                raise TypeError(f"{self.name}: a suspension without an engine cannot wait")
            wait = self._scope.call
        while True:
            resumed = False
            try:
                with self._lock:
                    if self._closed is not None:
                        raise RuntimeClosedError(f"{self.name} is closed ({self._closed})")
                    if self._mode is None:
                        return
                    if not self._held:
                        resumed = True
                        self._resume_locked()
                        return
                    self._check_holder()
            finally:
                if resumed:
                    self._notify()
            wait(self._wait_released())

    def check_holder(self) -> None:
        """Raise ``RuntimeError`` if this thread holds the suspension: a batch asked for
        here would wait for a ``resume()`` only this thread can make."""
        with self._lock:
            self._check_holder()

    def _check_holder(self) -> None:
        if self._held and self._holder == threading.get_ident():
            raise RuntimeError(
                f"{self.describe()}: this thread holds the suspension, so the next batch "
                "would wait for itself; call resume() (or leave the suspended() block) "
                "before asking for the next batch"
            )

    async def _wait_released(self) -> None:
        waiting = asyncio.ensure_future(self._gate.wait_async())
        try:
            done, _ = await asyncio.wait({waiting}, timeout=self.log_after_s)
            if not done:
                _log.warning(
                    "get_batch is waiting: %s; call resume() (or leave the suspended() "
                    "block) to go on",
                    self.describe(),
                )
            await waiting
        finally:
            waiting.cancel()
        if self._closed is not None:
            raise RuntimeClosedError(
                f"{self.name} was closed while get_batch waited for resume(): {self._closed}"
            )
