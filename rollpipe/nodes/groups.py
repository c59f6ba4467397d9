"""GroupAssembler: complete GRPO groups out of a stream of trajectories.

Trajectories arrive in any order; a group is emitted only once ``group_size`` good
members are in. With ``redundancy`` extra members running, the first ``group_size``
finishers win and the rest are cancelled. A group that a filter rejects, that is too
stale, or that errored beyond what redundancy covers is dropped, counted, and replaced
by a request for a new group, so a filter cannot starve the trainer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from rollpipe._utils.checks import check_int
from rollpipe.agent.records import Group, Trajectory
from rollpipe.nodes.signals import RolloutControl

GroupFilter = Callable[[Group], bool]
"""Returns True to keep a group."""


def drop_zero_variance(group: Group, eps: float = 1e-6) -> bool:
    """Keep a group only if its episode scores differ (all-equal scores give GRPO no signal)."""
    scores = np.array([t.score for t in group.trajectories], dtype=np.float64)
    return bool(scores.std() > eps)


FILTERS: dict[str, GroupFilter] = {"zero_variance": drop_zero_variance}


def resolve_filter(filter: str | GroupFilter | None) -> GroupFilter | None:
    """A filter given by name (see ``FILTERS``) or as a callable."""
    if filter is None or callable(filter):
        return filter
    if filter not in FILTERS:
        raise ValueError(
            f"filter: unknown name {filter!r}; use one of {sorted(FILTERS)} or a callable"
        )
    return FILTERS[filter]


class GroupAssembler(BaseNode[Group]):
    """Buffers trajectories by ``group_id`` and yields complete :class:`Group` records.

    Args:
        source: node yielding :class:`Trajectory`.
        group_size: members a group needs.
        redundancy: extra members started per group (errors up to this many are covered).
        filter: ``"zero_variance"`` or a callable ``Group -> bool`` (True keeps).
        max_staleness: drop a group whose oldest token is more than this many policy
            versions behind ``current_version()``.
        current_version: the trainer's current policy version (usually ``engine.version``).
        control: shared control; cancels redundant members and requests replacements.
        max_drops_in_a_row: groups dropped one after another, with none kept, before
            ``next()`` gives up with an error naming the reasons (a filter that rejects
            everything the policy produces would otherwise request replacements forever).

    Each yielded group carries ``drops``: the counts of what was dropped since the
    previous yielded group (``filtered``, ``stale``, ``errored``, ``empty`` groups;
    ``errored_trajectories`` (the env raised) and ``empty_trajectories`` (the first prompt
    exceeded ``max_length``, so no turn ran); ``redundant`` late members; ``incomplete``
    groups at the end of the stream).
    """

    def __init__(
        self,
        source: BaseNode[Trajectory],
        group_size: int,
        *,
        redundancy: int = 0,
        filter: str | GroupFilter | None = None,
        max_staleness: int | None = None,
        current_version: Callable[[], int] | None = None,
        control: RolloutControl | None = None,
        max_drops_in_a_row: int = 1000,
    ) -> None:
        super().__init__()
        check_int("GroupAssembler.max_drops_in_a_row", max_drops_in_a_row, 1)
        check_int("GroupAssembler.group_size", group_size, 1)
        check_int("GroupAssembler.redundancy", redundancy, 0)
        if max_staleness is not None:
            check_int("GroupAssembler.max_staleness (or None)", max_staleness, 0)
            if current_version is None:
                raise ValueError(
                    "GroupAssembler: max_staleness needs current_version "
                    "(e.g. current_version=lambda: engine.version)"
                )
        self.source = source
        self.group_size = group_size
        self.redundancy = redundancy
        self.filter = resolve_filter(filter)
        self.max_staleness = max_staleness
        self.current_version = current_version
        self.control = control
        self.max_drops_in_a_row = max_drops_in_a_row
        self._clear()

    def _clear(self) -> None:
        self._members: dict[int, list[Trajectory]] = {}
        self._errors: Counter[int] = Counter()
        self._closed: set[int] = set()
        self._drops: Counter[str] = Counter()
        self._group_drops: Counter[str] = Counter()  # groups dropped since one was kept
        self.total_drops: Counter[str] = Counter()  # since the last reset; for progress displays

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._clear()
        if initial_state is None:
            self.source.reset(None)
            return
        self.source.reset(initial_state["source"])
        self._members = {
            int(g): [Trajectory.from_state(t) for t in ts]
            for g, ts in initial_state["members"].items()
        }
        self._errors = Counter({int(g): n for g, n in initial_state["errors"].items()})
        self._closed = set(initial_state["closed"])
        self._drops = Counter(initial_state["drops"])

    def get_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "members": {g: [t.to_state() for t in ts] for g, ts in self._members.items()},
            "errors": dict(self._errors),
            "closed": sorted(self._closed),
            "drops": dict(self._drops),
        }

    def _close(self, group_id: int, drop_reason: str | None) -> None:
        """No more members of this group are wanted; replace it if it was dropped."""
        self._closed.add(group_id)
        self._members.pop(group_id, None)
        self._errors.pop(group_id, None)
        if self.control is not None:
            if self.redundancy or drop_reason is not None:
                self.control.cancel_group(group_id)
            if drop_reason is not None:
                self.control.request_groups(1)
        if drop_reason is not None:
            self._drop(drop_reason)
            self._group_drops[drop_reason] += 1
            if sum(self._group_drops.values()) >= self.max_drops_in_a_row:
                raise RuntimeError(
                    f"GroupAssembler: {sum(self._group_drops.values())} groups in a row were "
                    f"dropped and none kept ({dict(self._group_drops)}); with filter "
                    f"{getattr(self.filter, '__name__', self.filter)!r} and max_staleness "
                    f"{self.max_staleness!r} nothing this policy produces is usable. Loosen "
                    "the filter or max_staleness, fix the env, or raise max_drops_in_a_row"
                )

    @property
    def pending_drops(self) -> dict[str, int]:
        """Drops not yet reported on a yielded group (those after the last one)."""
        return dict(self._drops)

    def _drop(self, reason: str, n: int = 1) -> None:
        self._drops[reason] += n
        self.total_drops[reason] += n

    def _is_stale(self, group: Group) -> bool:
        if self.max_staleness is None or self.current_version is None:
            return False
        oldest = group.min_version  # -1: no token generated, nothing to be stale
        return oldest >= 0 and self.current_version() - oldest > self.max_staleness

    def _add(self, traj: Trajectory) -> Group | None:
        gid = traj.group_id
        if gid in self._closed:
            self._drop("redundant")
            return None
        if traj.end_reason == "error" or not traj.turns:
            # an env error, or no turn at all (first prompt over max_length): no row to train on
            failure = "errored" if traj.end_reason == "error" else "empty"
            self._drop(f"{failure}_trajectories")
            self._errors[gid] += 1
            if self._errors[gid] > self.redundancy:
                self._close(gid, failure)
            return None
        members = self._members.setdefault(gid, [])
        members.append(traj)
        if len(members) < self.group_size:
            return None
        group = Group(group_id=gid, trajectories=tuple(members))
        if self._is_stale(group):
            self._close(gid, "stale")
            return None
        if self.filter is not None and not self.filter(group):
            self._close(gid, "filtered")
            return None
        self._close(gid, None)
        self._group_drops.clear()
        drops, self._drops = dict(self._drops), Counter()
        return Group(group_id=gid, trajectories=group.trajectories, drops=drops)

    def next(self) -> Group:
        while True:
            try:
                traj = next(self.source)
            except StopIteration:
                if self._members:
                    self._drop("incomplete", len(self._members))
                    self._members.clear()
                raise
            group = self._add(traj)
            if group is not None:
                return group
