"""The side channel between stages: what cannot flow downstream with the records.

Records flow one way (specs → trajectories → groups → batches). Three signals flow
back: the admission gate (closed while the trainer updates weights), group
cancellations (redundant members no longer needed) and requests for replacement
groups (a group was filtered, stale or errored). One ``RolloutControl`` is shared by
the stages of a pipeline; each stage that needs it takes it as an argument, so a
stage used alone needs none.
"""

from __future__ import annotations

import asyncio
import threading


class RolloutControl:
    """Admission gate, cancelled groups and replacement requests, safe across threads."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()
        self._replacements = 0

    # -- admission gate -------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        """Whether new episodes and new engine requests may start."""
        return self._open.is_set()

    def close(self) -> None:
        """Stop admitting episodes and engine requests (in-flight work is left alone)."""
        self._open.clear()

    def open(self) -> None:
        """Admit again."""
        self._open.set()

    async def admit(self, poll_s: float = 0.002) -> None:
        """Return once the gate is open; awaited before every engine request.

        Polls rather than waiting on an asyncio.Event so that ``open()`` may come from
        any thread without knowing which event loop the episodes run on.
        """
        while not self._open.is_set():
            await asyncio.sleep(poll_s)

    def wait_open(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the gate is open (or ``timeout``)."""
        return self._open.wait(timeout)

    # -- cancellations --------------------------------------------------------------
    def cancel_group(self, group_id: int) -> None:
        """Members of ``group_id`` still queued or running are no longer wanted."""
        with self._lock:
            self._cancelled.add(group_id)

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
