"""The signals that flow back upstream, against the records.

Records flow one way (specs → trajectories → groups → batches). Three signals flow
back: the admission gate (closed while the trainer updates weights), group
cancellations (redundant members no longer needed) and requests for replacement
groups (a group was filtered, stale or errored). One ``RolloutControl`` is shared by
the stages of a pipeline; each stage that needs it takes it as an argument, so a
stage used alone needs none. A stage that must react to a signal at once (the rollout's
admission driver) registers a listener, called on every change from whatever thread
made it: nothing polls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rollpipe.runtime import Gate


class RolloutControl:
    """Admission gate, cancelled groups and replacement requests, safe across threads."""

    def __init__(self) -> None:
        self._gate = Gate(is_open=True)
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()
        self._replacements = 0
        self._listeners: list[Callable[[], None]] = []

    # -- listeners --------------------------------------------------------------------
    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change (it must be cheap and thread-safe)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _changed(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    # -- admission gate -------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        """Whether new episodes and new engine requests may start."""
        return self._gate.is_open

    def close(self) -> None:
        """Stop admitting episodes and engine requests (in-flight work is left alone)."""
        self._gate.close()
        self._changed()

    def open(self) -> None:
        """Admit again; wakes every request waiting in ``admit()`` on any loop."""
        self._gate.open()
        self._changed()

    async def admit(self) -> None:
        """Return once the gate is open; awaited before every engine request."""
        await self._gate.wait_async()

    # -- cancellations --------------------------------------------------------------
    def cancel_group(self, group_id: int) -> None:
        """Members of ``group_id`` still queued or running are no longer wanted."""
        with self._lock:
            self._cancelled.add(group_id)
        self._changed()

    def is_cancelled(self, group_id: int) -> bool:
        with self._lock:
            return group_id in self._cancelled

    def cancelled_groups(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._cancelled)

    # -- replacement work -----------------------------------------------------------
    def request_groups(self, n: int = 1) -> None:
        """Ask the episode source for ``n`` more groups (to replace dropped ones)."""
        if n < 0:
            raise ValueError(f"request_groups: n must be >= 0, got {n}")
        with self._lock:
            self._replacements += n
        self._changed()

    @property
    def replacements_pending(self) -> int:
        with self._lock:
            return self._replacements

    def take_replacements(self) -> int:
        """Hand all pending replacement requests to the caller (the episode source)."""
        with self._lock:
            n, self._replacements = self._replacements, 0
            return n

    # -- checkpointing --------------------------------------------------------------
    def get_state(self) -> dict[str, object]:
        with self._lock:
            return {"cancelled": sorted(self._cancelled), "replacements": self._replacements}

    def load_state(self, state: dict[str, object] | None) -> None:
        with self._lock:
            if state is None:
                self._cancelled, self._replacements = set(), 0
            else:
                self._cancelled = set(state["cancelled"])  # type: ignore[call-overload]
                self._replacements = int(state["replacements"])  # type: ignore[call-overload]
