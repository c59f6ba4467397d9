"""Batch: whole groups into batches of exactly ``num_trajectories`` trajectories.

Batching comes before collation so that padding happens once, to the batch's own
longest row. The record it yields, :class:`TrajectoryBatch`, still holds trajectory
records; ``Collate`` turns it into a ``DataProto``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import attrs
from torchdata.nodes import BaseNode

from rollpipe._utils.checks import check_int
from rollpipe.agent.records import Group, Trajectory


@attrs.frozen
class TrajectoryBatch:
    """Whole groups making up one training batch, with drop counts and timing.

    ``wall_time_s`` is how long the consumer waited since the previous batch (small when
    the next batch was already complete); ``stream_time_s`` and ``stream_tokens`` count
    from the start of the stream, so their ratio is the sustained generation rate.
    """

    groups: tuple[Group, ...]
    drops: dict[str, int] = attrs.field(factory=dict)
    wall_time_s: float = 0.0
    stream_time_s: float = 0.0
    stream_tokens: int = 0

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    def __len__(self) -> int:
        return sum(len(g.trajectories) for g in self.groups)


class Batch(BaseNode[TrajectoryBatch]):
    """Concatenates groups until exactly ``num_trajectories`` (``-1``: until the end).

    ``num_trajectories`` may be changed between calls (``RolloutPipeline.get_batch``
    does). At the end of the stream a smaller final batch is yielded unless
    ``drop_last``.
    """

    def __init__(
        self, source: BaseNode[Group], num_trajectories: int, *, drop_last: bool = False
    ) -> None:
        super().__init__()
        self.source = source
        self.num_trajectories = num_trajectories
        self.drop_last = drop_last
        self._check_size(num_trajectories)
        self._carry: list[Group] = []  # a group that did not fit, kept for the next batch
        self._start = self._last_emit = time.perf_counter()
        self._stream_tokens = 0

    @staticmethod
    def _check_size(n: int) -> None:
        if n != -1:
            check_int("Batch.num_trajectories (or -1: all)", n, 1)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])
        carry = [] if initial_state is None else initial_state["carry"]
        self._carry = [Group.from_state(g) for g in carry]
        self._start = self._last_emit = time.perf_counter()
        self._stream_tokens = 0

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "carry": [g.to_state() for g in self._carry]}

    def next(self) -> TrajectoryBatch:
        target = self.num_trajectories
        self._check_size(target)
        groups: list[Group] = []
        drops: Counter[str] = Counter()
        count = 0
        while target == -1 or count < target:
            try:
                group = self._carry.pop() if self._carry else next(self.source)
            except StopIteration:
                if not groups or (self.drop_last and target != -1):
                    raise
                break
            size = len(group.trajectories)
            if target != -1 and count + size > target:
                self._carry = [*groups, group][::-1]  # nothing is lost: retried next call
                raise ValueError(
                    f"Batch: num_trajectories={target} is not a multiple of the group size "
                    f"({size}); a batch holds whole groups — pick a multiple of {size}"
                )
            groups.append(group)
            drops.update(group.drops)
            count += size
        now = time.perf_counter()
        wall, self._last_emit = now - self._last_emit, now
        self._stream_tokens += sum(t.num_generated_tokens for g in groups for t in g.trajectories)
        return TrajectoryBatch(
            groups=tuple(groups),
            drops=dict(drops),
            wall_time_s=wall,
            stream_time_s=now - self._start,
            stream_tokens=self._stream_tokens,
        )
