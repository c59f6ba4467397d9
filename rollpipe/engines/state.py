"""EngineState: what an engine is (policy version, pause mode, interruptions, closed,
dead) and the rules for changing it, written once for ``BaseEngine`` and ``EnginePool``.

The two differ only in how they run one transition at a time: ``BaseEngine`` on its event
loop under an ``asyncio.Lock``, ``EnginePool`` on caller threads under a
``threading.Lock``. So the state takes no lock. Its owner serialises the transitions
(``pausing`` / ``resuming`` / ``updating``, context managers that work in sync and async
code alike) and the state refuses one begun while another runs: that is a missing lock,
not a race to wait out. Reads are single attribute loads, safe from any thread.
``EngineStateView`` gives an owner the public properties.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

from rollpipe._utils.checks import check_int
from rollpipe.engines.protocol import PAUSE_MODES, PauseMode
from rollpipe.engines.records import EngineClosedError, EngineError

__all__ = ["EngineState", "EngineStateView", "check_new_version", "check_pause_mode"]


def check_pause_mode(mode: str) -> PauseMode:
    """``mode`` if it is one of ``PAUSE_MODES``, else a ValueError listing them."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return cast(PauseMode, mode)


def check_new_version(version: int | None) -> int | None:
    """``update_weights``'s ``version``: None (the current one + 1) or an int >= 0."""
    if version is not None:
        check_int("update_weights: version", version, 0)
    return version


class EngineState:
    """One engine's state and its transitions; ``owner`` and ``noun`` name it in errors.

    Examples:
        >>> state = EngineState("MyEngine", version=3)
        >>> with state.pausing("abort"):
        ...     pass  # the owner pauses its backend here
        >>> state.pause_mode, state.interruptions
        ('abort', 1)
        >>> with state.updating(None) as new_version:
        ...     new_version  # the owner loads the weights here
        4
        >>> with state.resuming():
        ...     pass
        >>> state.version, state.pause_mode, state.interruptions
        (4, None, 3)
        >>> state.close(), state.close(), state.closed
        (True, False, True)
    """

    def __init__(self, owner: str, *, version: int = 0, noun: str = "engine") -> None:
        self.owner = owner
        self._noun = noun
        self._version = check_int(f"{owner}: version", version, 0)
        self._pause_mode: PauseMode | None = None
        self._interruptions = 0  # pauses, resumes and weight updates so far
        self._closed = False
        self._dead: BaseException | None = None
        self._busy = False  # a transition runs

    # -- reads -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def pause_mode(self) -> PauseMode | None:
        return self._pause_mode

    @property
    def interruptions(self) -> int:
        return self._interruptions

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def dead(self) -> BaseException | None:
        """Why the engine can no longer generate, None while it can (or once closed)."""
        return self._dead

    def check_open(self) -> None:
        """Raise EngineClosedError once closed, EngineError (from the cause) once dead."""
        if self._closed:
            raise EngineClosedError(
                f"{self.owner} is closed; create a new {self._noun} to generate again"
            )
        if self._dead is not None:
            raise EngineError(
                f"{self.owner} died ({self._dead!r}); create a new {self._noun}"
            ) from self._dead

    # -- life --------------------------------------------------------------------------
    def mark_dead(self, error: BaseException) -> None:
        """The engine can no longer generate; the first cause is kept."""
        if self._dead is None:
            self._dead = error

    def close(self) -> bool:
        """Mark the engine closed; True for the call that closed it (it tears down)."""
        if self._closed:
            return False
        self._closed = True
        return True

    # -- transitions: the owner runs one at a time -------------------------------------
    @contextlib.contextmanager
    def pausing(self, mode: PauseMode) -> Iterator[None]:
        """Set ``mode`` and count an interruption, then let the owner pause; if that
        raises, the previous mode comes back."""
        mode = check_pause_mode(mode)
        with self._one_at_a_time():
            previous, self._pause_mode = self._pause_mode, mode
            self._interruptions += 1
            try:
                yield
            except BaseException:
                self._pause_mode = previous
                raise

    @contextlib.contextmanager
    def resuming(self) -> Iterator[None]:
        """Clear the mode and count an interruption, then let the owner resume."""
        with self._one_at_a_time():
            self._pause_mode = None
            self._interruptions += 1
            yield

    @contextlib.contextmanager
    def updating(self, version: int | None) -> Iterator[int]:
        """Count an interruption and yield the new version (``version``, or the current
        one + 1) for the owner to load; stored when the load returns, not if it raises."""
        checked = check_new_version(version)
        with self._one_at_a_time():
            new_version = self._version + 1 if checked is None else checked
            self._interruptions += 1
            yield new_version
            self._version = new_version

    @contextlib.contextmanager
    def _one_at_a_time(self) -> Iterator[None]:
        if self._busy:
            raise RuntimeError(
                f"{self.owner}: a pause / resume / weight update began while another ran; "
                "its owner must run them one at a time (under its lock)"
            )
        self._busy = True
        try:
            yield
        finally:
            self._busy = False


class EngineStateView:
    """The public properties of an owner of an ``EngineState`` (``self._state``)."""

    _state: EngineState

    @property
    def version(self) -> int:
        """The policy version of the weights the engine generates with now.

        Examples:
            >>> import torch
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     before = scripted.version
            ...     scripted.update_weights(torch.nn.Linear(2, 2))  # returns the new version
            ...     before, scripted.version
            1
            (0, 1)
        """
        return self._state.version

    @property
    def is_paused(self) -> bool:
        """Whether the engine is paused (``pause`` was called, ``resume`` not yet).

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     scripted.pause("wait")
            ...     paused = scripted.is_paused
            ...     scripted.resume()
            ...     paused, scripted.is_paused
            (True, False)
        """
        return self._state.pause_mode is not None

    @property
    def pause_mode(self) -> PauseMode | None:
        """The mode of the current pause, None while running.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     scripted.pause("keep")
            ...     mode = scripted.pause_mode
            ...     scripted.resume()
            ...     mode, scripted.pause_mode
            ('keep', None)
        """
        return self._state.pause_mode

    @property
    def interruptions(self) -> int:
        """Pauses, resumes and weight updates so far (see ``Engine.interruptions``).

        Examples:
            >>> import torch
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     scripted.pause()
            ...     scripted.resume()
            ...     version = scripted.update_weights(torch.nn.Linear(2, 2))
            ...     scripted.interruptions
            3
        """
        return self._state.interruptions

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (``generate`` then raises ``EngineClosedError``).

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     print(scripted.closed)
            False
            >>> scripted.closed  # the with block closed it
            True
        """
        return self._state.closed

    @property
    def alive(self) -> bool:
        """Whether the engine can still generate (neither closed nor dead).

        Examples:
            >>> engine.alive
            True
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> scripted = ScriptedEngine(lambda prompt_ids, params: [7])
            >>> scripted.close()
            >>> scripted.alive
            False
        """
        return not self._state.closed and self._state.dead is None
