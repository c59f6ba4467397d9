"""Admitted: the Rollout's book of episodes admitted and not yet yielded, and their results.

Each admitted spec gets an index (admission order). A finished episode's result waits
here until it is yielded: in admission order (``in_order``, reproducible) or in
completion order. The book also knows the lowest group id that still has a member in it,
which tells downstream stages which groups are settled (``UpstreamSignals.settle_below``).
"""

from __future__ import annotations

from collections import deque

from rollpipe.agent.records import EpisodeSpec, Trajectory


class Admitted:
    """Specs admitted (by index) and the results of those that finished (None: cancelled)."""

    def __init__(self, in_order: bool) -> None:
        self.in_order = in_order
        self.pending: dict[int, EpisodeSpec] = {}  # admitted, not yet yielded
        self.results: dict[int, Trajectory | None] = {}  # finished, not yet yielded
        self._finish_order: deque[int] = deque()
        self._next_index = 0
        self._emit_index = 0

    def admit(self, spec: EpisodeSpec) -> int:
        index = self._next_index
        self._next_index += 1
        self.pending[index] = spec
        return index

    def finish(self, index: int, result: Trajectory | None) -> None:
        self.results[index] = result
        self._finish_order.append(index)

    def pop(self) -> tuple[EpisodeSpec, Trajectory | None] | None:
        """The next result to yield (with its spec), or None if it has not finished."""
        if self.in_order:
            index = self._emit_index
            if index not in self.results:
                return None
            self._emit_index += 1
        else:
            if not self._finish_order:
                return None
            index = self._finish_order.popleft()
        return self.pending.pop(index), self.results.pop(index)

    def lowest_group(self, also: list[EpisodeSpec], pulled: int | None) -> int | None:
        """The lowest group id that may still yield: of the specs held here, in ``also``
        (queued) and ``pulled`` (the last id pulled: later pulls are never lower)."""
        ids = [s.group_id for s in self.pending.values()] + [s.group_id for s in also]
        if pulled is not None:
            ids.append(pulled)
        return min(ids) if ids else None
