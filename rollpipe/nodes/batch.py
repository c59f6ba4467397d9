"""Batch: whole groups into batches of exactly ``num_trajectories`` trajectories.

Batching comes before collation so that padding happens once, to the batch's own
longest row. The record it yields, :class:`TrajectoryBatch`, still holds trajectory
records; ``Collate`` turns it into a ``DataProto``.

With ``max_staleness`` a batch is checked again as it completes, by the rule the group
assembler applies (``group_rules.is_stale``): a group that became too old while it waited here (the
weights were updated after it was accepted) is dropped, counted (``stale``, its tokens in
``wasted_tokens``), and replaced through the signals, so with ``max_staleness=0`` a batch
holds only tokens of the weights current when it is returned.

With ``wait=True`` (``max_off_policy_strategy="wait"``) a batch instead takes the oldest
live groups by the version they started at (the signals' ledger), waiting for those not
finished yet, and among groups of the same version the first to finish; it also waits
for every group that would be too old after one more update. The rest are carried to
the next batch. With the pipeline's grants (AReaL's admission bound) and one update per
batch, no group goes stale: groups leave oldest first, so the ones at the bound always
fit in the batch. The staleness check above stays as a safety net (weights updated more
often than once per batch).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
from torchdata.nodes import BaseNode

from rollpipe._utils.checks import check_int
from rollpipe.agent.records import Group, Trajectory
from rollpipe.nodes.group_rules import is_stale
from rollpipe.nodes.signals import PipelineSignals


@attrs.frozen
class TrajectoryBatch:
    """Whole groups making up one training batch, with drop counts and timing.

    ``wall_time_s`` is how long the consumer waited since the previous batch (small when
    the next batch was already complete); ``stream_time_s`` and ``stream_tokens`` count
    from the start of the stream, so their ratio is the sustained generation rate.

    Examples:
        >>> from rollpipe.agent.records import EpisodeSpec
        >>> def traj(group, episode):  # no turns: its first prompt was too long
        ...     return Trajectory(EpisodeSpec(group, episode, 0), 0, [], 0, False, "max_length")
        >>> item = TrajectoryBatch((Group(0, [traj(0, 0), traj(0, 1)]),), drops={"stale": 1})
        >>> len(item), [t.traj_id for t in item.trajectories], item.drops
        (2, ['frozenlake/g0/e0', 'frozenlake/g0/e1'], {'stale': 1})
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

    ``request(n)`` sets the size of the next batch only (``RolloutPipeline.get_batch``
    calls it with each request); ``num_trajectories`` is the size otherwise. At the end of
    the stream a smaller final batch is yielded unless ``drop_last``.

    Args:
        source: node yielding complete :class:`Group` records.
        num_trajectories: trajectories per batch (a multiple of the group size), or -1.
        drop_last: drop a smaller final batch.
        max_staleness: re-check each batch as it completes (see the module doc); None:
            no check.
        current_version: the current policy version (needed with ``max_staleness``).
        signals: receives a replacement request for each group dropped here, and learns
            which groups the trainer consumed (``retire``).
        wait: wait for the groups about to go stale and take the oldest first (see the
            module doc); needs ``max_staleness`` and ``signals``.

    Examples:
        >>> from torchdata.nodes import IterableWrapper
        >>> from rollpipe.agent.records import EpisodeSpec
        >>> def traj(group, episode):
        ...     return Trajectory(EpisodeSpec(group, episode, 0), 0, [], 0, False, "max_length")
        >>> groups = [Group(g, [traj(g, 2 * g), traj(g, 2 * g + 1)]) for g in range(3)]
        >>> [len(b) for b in Batch(IterableWrapper(groups), 4)]  # the last one is smaller
        [4, 2]
        >>> [len(b) for b in Batch(IterableWrapper(groups), 4, drop_last=True)]
        [4]
        >>> node = Batch(IterableWrapper(groups), 4)
        >>> node.reset(); node.request(2)  # the next batch only, as get_batch(2) does
        >>> [len(b) for b in node]
        [2, 4]
    """

    def __init__(
        self,
        source: BaseNode[Group],
        num_trajectories: int,
        *,
        drop_last: bool = False,
        max_staleness: int | None = None,
        current_version: Callable[[], int] | None = None,
        signals: PipelineSignals | None = None,
        wait: bool = False,
    ) -> None:
        super().__init__()
        self.source = source
        self.num_trajectories = num_trajectories
        self.drop_last = drop_last
        self._check_size(num_trajectories)
        if max_staleness is not None:
            check_int("Batch.max_staleness (or None)", max_staleness, 0)
            if current_version is None:
                raise ValueError("Batch: max_staleness needs current_version")
        self.max_staleness = max_staleness
        self.current_version = current_version
        self.signals = signals
        if wait and (max_staleness is None or signals is None):
            raise ValueError("Batch: wait=True needs max_staleness and signals")
        self.wait = wait
        self._requested: int | None = None  # the next batch's size, from request()
        self._carry: list[Group] = []  # a group that did not fit, kept for the next batch
        self._dropped = Group(0, ())  # the counts of groups dropped here, not yet reported
        self._start = self._last_emit = time.perf_counter()
        self._stream_tokens = 0

    @staticmethod
    def _check_size(n: int) -> None:
        if n != -1:
            check_int("Batch.num_trajectories (or -1: all)", n, 1)

    def request(self, num_trajectories: int) -> None:
        """The next batch holds ``num_trajectories`` (-1: until the end); later batches
        go back to ``self.num_trajectories``."""
        self._check_size(num_trajectories)
        self._requested = num_trajectories

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])
        carry = [] if initial_state is None else initial_state["carry"]
        self._carry = [Group.from_state(g) for g in carry]
        dropped = None if initial_state is None else initial_state.get("dropped")
        self._dropped = Group(0, ()) if dropped is None else Group.from_state(dropped)
        self._requested = None
        self._start = self._last_emit = time.perf_counter()
        self._stream_tokens = 0

    def get_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "carry": [g.to_state() for g in self._carry],
            "dropped": self._dropped.to_state(),
        }

    def _fresh(self, groups: list[Group]) -> list[Group]:
        """The groups not stale against the version now (read once, for all of them)."""
        if self.max_staleness is None or self.current_version is None:
            return groups
        current, limit = self.current_version(), self.max_staleness
        return [g for g in groups if not is_stale(g, current, limit)]

    def _drop_stale(self, group: Group) -> None:
        """Count ``group`` (and the drops it carried) as dropped here; ask for another."""
        trajs = group.trajectories
        tag = trajs[0].tag if trajs else ""
        wasted = sum(t.num_generated_tokens + t.aborted_tokens for t in trajs)
        drops = Counter(self._dropped.drops) + Counter(group.drops)
        drops.update({"stale": 1, "wasted_tokens": wasted})
        tag_drops = {t: Counter(c) for t, c in self._dropped.tag_drops.items()}
        for t, counts in group.tag_drops.items():
            tag_drops.setdefault(t, Counter()).update(counts)
        tag_drops.setdefault(tag, Counter()).update({"stale": 1, "wasted_tokens": wasted})
        errors = (*self._dropped.errors, *group.errors)
        self._dropped = Group(0, (), drops=drops, tag_drops=tag_drops, errors=errors)
        if self.signals is not None:
            self.signals.retire(group.group_id)
            self.signals.request_groups(1)

    def _older_upstream(self, held: list[Group], target: int) -> bool:
        """Wait policy: a live group not here yet must be in this batch, because it
        started before a group the batch would take, or it would be too old after one
        more update."""
        if self.signals is None or self.current_version is None or not held:
            return False
        started = self.signals.started_versions()
        here = {g.group_id for g in held}
        upstream = [v for g, v in started.items() if g not in here]
        if not upstream:
            return False
        due = self.current_version() - (self.max_staleness or 0)
        if min(upstream) <= due:
            return True
        if target == -1:
            return False
        fill = -(-target // len(held[0].trajectories))  # groups this batch takes
        here_versions = sorted(started.get(g.group_id, g.min_version) for g in held)
        return min(upstream) < here_versions[min(fill, len(held)) - 1]

    def _collect(self, target: int, groups: list[Group]) -> list[Group]:
        """Groups for a batch of ``target`` trajectories, after the ``groups`` kept."""
        if self.wait:
            return self._collect_oldest(target, groups)
        count = sum(len(g.trajectories) for g in groups)
        while target == -1 or count < target:
            try:
                group = self._carry.pop() if self._carry else next(self.source)
            except StopIteration:
                if not groups or (self.drop_last and target != -1):
                    raise
                break
            self._check_fit(target, count, group, [*groups, group])
            groups.append(group)
            count += len(group.trajectories)
        return groups

    def _collect_oldest(self, target: int, groups: list[Group]) -> list[Group]:
        """Wait policy: pull until the batch is full and no older group is upstream,
        then take the oldest groups by start version (ties: first to finish); carry
        the rest. Taking them oldest first keeps every later batch within the bound."""
        held = [*groups, *self._carry[::-1]]
        self._carry = []
        ended = False
        while target == -1 or self._size(held) < target or self._older_upstream(held, target):
            try:
                held.append(next(self.source))
            except StopIteration:
                ended = True
                break
        started = self.signals.started_versions() if self.signals is not None else {}
        held.sort(key=lambda g: started.get(g.group_id, g.min_version))  # stable: ties
        taken: list[Group] = []
        for group in held:
            if target != -1 and self._size(taken) >= target:
                break
            self._check_fit(target, self._size(taken), group, held)
            taken.append(group)
        self._carry = held[len(taken) :][::-1]
        short = target != -1 and self._size(taken) < target
        if not taken or (ended and short and self.drop_last):
            self._carry = held[::-1]
            raise StopIteration
        return taken

    @staticmethod
    def _size(groups: list[Group]) -> int:
        return sum(len(g.trajectories) for g in groups)

    def _check_fit(self, target: int, count: int, group: Group, keep: list[Group]) -> None:
        """A batch holds whole groups: ``group`` must not overflow ``target`` (else
        ``keep`` is carried, nothing lost, and the error names the sizes)."""
        size = len(group.trajectories)
        if target != -1 and count + size > target:
            self._carry = keep[::-1]
            raise ValueError(
                f"Batch: num_trajectories={target} is not a multiple of the group "
                f"size ({size}); a batch holds whole groups — pick a multiple of {size}"
            )

    def _with_dropped(self, group: Group) -> Group:
        """``group`` carrying the counts of the groups dropped here before it."""
        if not (self._dropped.drops or self._dropped.tag_drops or self._dropped.errors):
            return group
        drops = Counter(self._dropped.drops) + Counter(group.drops)
        tag_drops = {t: Counter(c) for t, c in self._dropped.tag_drops.items()}
        for t, counts in group.tag_drops.items():
            tag_drops.setdefault(t, Counter()).update(counts)
        errors = (*self._dropped.errors, *group.errors)
        self._dropped = Group(0, ())
        return attrs.evolve(group, drops=drops, tag_drops=tag_drops, errors=errors)

    def next(self) -> TrajectoryBatch:
        target = self.num_trajectories if self._requested is None else self._requested
        self._requested = None
        self._check_size(target)
        groups: list[Group] = []
        while True:
            groups = self._collect(target, groups)
            fresh = self._fresh(groups)
            if len(fresh) == len(groups):
                break
            for group in groups:  # the weights changed while they waited here
                if not any(group is f for f in fresh):
                    self._drop_stale(group)
            groups = fresh
        if groups:
            groups[0] = self._with_dropped(groups[0])
        drops: Counter[str] = Counter()
        for group in groups:
            drops.update(group.drops)
        if self.signals is not None:
            for group in groups:  # consumed: they leave the ledger of live groups
                self.signals.retire(group.group_id)
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
