"""Admitted: the EpisodeRunner's book of episodes admitted and not yet yielded, and their results.

Each admitted spec gets an index (admission order). A finished episode's result waits
here until it is yielded: in admission order (``in_order``, reproducible) or in
completion order. The book also knows the lowest group id that still has a member in it,
which tells downstream stages which groups are settled (``PipelineSignals.settle_below``).
"""

from __future__ import annotations

import heapq
from collections import deque

from rollpipe.agent.records import EpisodeSpec, Trajectory


class Admitted:
    """Specs admitted (by index) and the results of those that finished (None: cancelled)."""

    def __init__(self, in_order: bool) -> None:
        self.in_order = in_order
        self.pending: dict[int, EpisodeSpec] = {}  # admitted, not yet yielded
        self.results: dict[int, Trajectory | None] = {}  # finished, not yet yielded
        self._finish_order: deque[int] = deque()
        self._group_members: dict[int, int] = {}  # group id -> its specs in pending
        self._group_heap: list[int] = []  # those group ids (and some gone: skipped lazily)
        self._next_index = 0
        self._emit_index = 0

    def admit(self, spec: EpisodeSpec) -> int:
        index = self._next_index
        self._next_index += 1
        self.pending[index] = spec
        group = spec.group_id
        members = self._group_members.get(group, 0)
        if members == 0:
            heapq.heappush(self._group_heap, group)
        self._group_members[group] = members + 1
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
        spec = self.pending.pop(index)
        members = self._group_members[spec.group_id] - 1
        if members:
            self._group_members[spec.group_id] = members
        else:
            del self._group_members[spec.group_id]
        return spec, self.results.pop(index)

    def lowest_group(self, also: list[EpisodeSpec], pulled: int | None) -> int | None:
        """The lowest group id that may still yield: of the specs held here, in ``also``
        (queued) and ``pulled`` (the last id pulled: later pulls are never lower).
        O(log n) amortized over the book's groups (a heap of their ids)."""
        heap = self._group_heap
        while heap and heap[0] not in self._group_members:  # its last member left
            heapq.heappop(heap)
        ids = [s.group_id for s in also]
        if heap:
            ids.append(heap[0])
        if pulled is not None:
            ids.append(pulled)
        return min(ids) if ids else None
