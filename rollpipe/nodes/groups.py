"""GroupAssembler: complete GRPO groups out of a stream of trajectories.

Trajectories arrive in any order; a group is emitted only once ``group_size`` good
members are in. With ``redundancy`` extra members running, the first ``group_size``
finishers win and the rest are cancelled. A group that ``keep_group`` / ``drop_group``
rejects, that is too stale, or that errored beyond what redundancy covers is dropped,
counted (overall and per env tag), and replaced by a request for a new group, so a
strict rule cannot starve the trainer. An env tag that gives nothing but errors ends the
stream early (``rollpipe.nodes.error_runs``). The rules themselves live in
``rollpipe.nodes.group_rules``; :class:`GroupSettings` holds this stage's settings.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
from torchdata.nodes import BaseNode

from rollpipe._utils.checks import check_fields, check_int, int_in, seconds_or_none
from rollpipe.agent.env_errors import error_entry
from rollpipe.agent.records import Group, Trajectory
from rollpipe.nodes.episode_source import SourceSettings
from rollpipe.nodes.error_runs import ErrorRun, ErrorRuns
from rollpipe.nodes.group_rules import (
    DROP_RULES,
    KEEP_RULES,
    GroupRule,
    check_group_rule,
    is_stale,
    resolve_group_rule,
    scores_differ,
    zero_variance,
)
from rollpipe.nodes.signals import PipelineSignals
from rollpipe.nodes.starved import starved_message

__all__ = [
    "DROP_RULES",
    "KEEP_RULES",
    "MAX_ERRORS_KEPT",
    "GroupAssembler",
    "GroupRule",
    "GroupSettings",
    "check_group_rule",
    "resolve_group_rule",
    "scores_differ",
    "zero_variance",
]
MAX_ERRORS_KEPT = 32
"""Errored trajectories whose text a yielded group carries (the most recent; all counted)."""

MAX_DROPS_IN_A_ROW = 10**6


@attrs.frozen(kw_only=True)
class GroupSettings:
    """Which complete groups are kept (``PipelineConfig.groups``), checked here once.

    ``keep_group`` keeps a group on True, ``drop_group`` drops it on True (ROLL's
    ``filter()`` polarity): a callable ``Group -> bool``, a registered name
    (``KEEP_RULES`` / ``DROP_RULES``) or an import path ``"package.module:function"``.
    ``max_drops_in_a_row``: groups dropped one after another, none kept, before the
    assembler gives up with an error (at most ``MAX_DROPS_IN_A_ROW``); for any drop
    reason, filtered groups included, so it is large.
    ``max_errors_in_a_row``: errored trajectories of one kind (exception type and call)
    that one env tag gives with no usable trajectory between them before the assembler
    gives up early (``rollpipe.nodes.error_runs``); ``max_error_seconds``: how long an env
    tag may give only errors (at least ``TIMED_MIN_ERRORS``) before it gives up (None: no
    time limit). Neither counts filtered, stale or empty groups.

    Examples:
        >>> GroupSettings(drop_group="zero_variance", max_error_seconds=None).drop_group
        'zero_variance'
        >>> GroupSettings(keep_group="no_such_rule")
        Traceback (most recent call last):
        ...
        ValueError: ...no_such_rule...
    """

    keep_group: str | GroupRule | None = attrs.field(default=None, validator=check_group_rule)
    drop_group: str | GroupRule | None = attrs.field(default=None, validator=check_group_rule)
    max_drops_in_a_row: int = attrs.field(default=1000, validator=int_in(1, MAX_DROPS_IN_A_ROW))
    max_errors_in_a_row: int = attrs.field(default=64, validator=int_in(1, MAX_DROPS_IN_A_ROW))
    max_error_seconds: float | None = attrs.field(default=60.0, validator=seconds_or_none())


class GroupAssembler(BaseNode[Group]):
    """Buffers trajectories by ``group_id`` and yields complete :class:`Group` records.

    Args:
        source: node yielding :class:`Trajectory`.
        group_size: members a group needs.
        redundancy: extra members started per group (errors up to this many are covered).
        keep_group: keep a complete group only when this says True: a callable
            ``Group -> bool``, a name in ``KEEP_RULES`` (``"scores_differ"``) or an
            import path ``"package.module:function"``.
        drop_group: drop a complete group when this says True (ROLL's ``filter()``
            polarity): a callable, a name in ``DROP_RULES`` (``"zero_variance"``) or an
            import path. Both may be given: a group must pass both.
        max_staleness: drop a group whose oldest token is more than this many policy
            versions behind ``current_version()`` (the ``drop`` policy; with ``wait``
            the chain leaves it None and the Batch keeps groups from going stale).
        current_version: the trainer's current policy version (usually ``engine.version``).
        signals: shared signals: cancels redundant members and requests replacements.
        max_drops_in_a_row: groups dropped one after another, with none kept, before
            ``next()`` gives up with an error naming the reasons, the settings behind them
            and the last env errors (``rollpipe.nodes.starved``; a rule that rejects
            everything the policy produces would otherwise request replacements forever).
        max_errors_in_a_row: errored trajectories of one kind from one env tag, none of
            its trajectories usable in between, before ``next()`` gives up early with
            that error (``rollpipe.nodes.error_runs``).
        max_error_seconds: how long one env tag may give only errors (at least
            ``TIMED_MIN_ERRORS`` of them) before ``next()`` gives up early; None: no limit.
        clock: the time in seconds for ``max_error_seconds`` (``time.monotonic``).

    Each yielded group carries ``drops``: the counts of what was dropped since the
    previous yielded group (``filtered``, ``stale``, ``errored``, ``empty`` groups;
    ``errored_trajectories`` (the env raised) and ``empty_trajectories`` (the first prompt
    exceeded ``max_length``, so no turn ran); ``redundant`` late members; ``incomplete``
    groups at the end of the stream; ``wasted_tokens``, the generated tokens of everything
    dropped), and ``tag_drops``: the same counts split by the env tag of what was dropped;
    ``errors``: the text of the last ``MAX_ERRORS_KEPT`` errored trajectories among them.
    ``errored_trajectories`` counts every errored trajectory that reaches the assembler,
    members of groups already dropped included (the EpisodeRunner passes those on).

    Memory stays bounded on an endless stream: a closed group's id is forgotten once the
    EpisodeRunner reports (``signals.settled_below``) that no member of it can arrive any more.

    Examples:
        >>> from torchdata.nodes import IterableWrapper
        >>> from rollpipe.agent.records import EpisodeSpec, Turn
        >>> turn = Turn([1, 2], [3], [-0.5], [0], 0.0, "stop", True, "Left", "")
        >>> def traj(group, episode, score):
        ...     return Trajectory(EpisodeSpec(group, episode, 0), 0, [turn], score, 1, "max_turns")
        >>> arrivals = [traj(0, 0, 1.0), traj(1, 2, 0.0), traj(1, 3, 0.0), traj(0, 1, 0.0)]
        >>> node = GroupAssembler(IterableWrapper(arrivals), 2, drop_group="zero_variance")
        >>> [(group.group_id, group.drops) for group in node]  # group 1 scored 0 twice
        [(0, {'wasted_tokens': 2, 'filtered': 1})]
    """

    def __init__(
        self,
        source: BaseNode[Trajectory],
        group_size: int,
        *,
        redundancy: int = 0,
        keep_group: str | GroupRule | None = None,
        drop_group: str | GroupRule | None = None,
        max_staleness: int | None = None,
        current_version: Callable[[], int] | None = None,
        signals: PipelineSignals | None = None,
        max_drops_in_a_row: int = 1000,
        max_errors_in_a_row: int = 64,
        max_error_seconds: float | None = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        check_fields(  # GroupSettings' checks, the one place these rules live
            "GroupAssembler",
            GroupSettings,
            keep_group=keep_group,
            drop_group=drop_group,
            max_drops_in_a_row=max_drops_in_a_row,
            max_errors_in_a_row=max_errors_in_a_row,
            max_error_seconds=max_error_seconds,
        )
        check_fields("GroupAssembler", SourceSettings, group_size=group_size, redundancy=redundancy)
        if max_staleness is not None:
            check_int("GroupAssembler.max_staleness (or None)", max_staleness, 0)
            if current_version is None:
                raise ValueError(
                    "GroupAssembler: max_staleness needs current_version "
                    "(e.g. current_version=lambda: engine.version)"
                )
        self.keep_group = resolve_group_rule(keep_group, "GroupAssembler.keep_group")
        self.drop_group = resolve_group_rule(drop_group, "GroupAssembler.drop_group")
        self.source = source
        self.group_size = group_size
        self.redundancy = redundancy
        self.max_staleness = max_staleness
        self.current_version = current_version
        self.signals = signals
        self.max_drops_in_a_row = max_drops_in_a_row
        self._runs = ErrorRuns(max_errors_in_a_row, max_error_seconds, clock)
        self._clear()

    @classmethod
    def from_settings(
        cls,
        source: BaseNode[Trajectory],
        settings: GroupSettings,
        group_size: int,
        **wiring: Any,
    ) -> GroupAssembler:
        """The assembler ``settings`` describe; ``wiring``: ``redundancy``,
        ``max_staleness``, ``current_version``, ``signals`` (see the class doc)."""
        return cls(
            source,
            group_size,
            keep_group=settings.keep_group,
            drop_group=settings.drop_group,
            max_drops_in_a_row=settings.max_drops_in_a_row,
            max_errors_in_a_row=settings.max_errors_in_a_row,
            max_error_seconds=settings.max_error_seconds,
            **wiring,
        )

    def _clear(self) -> None:
        self._members: dict[int, list[Trajectory]] = {}
        self._errors: Counter[int] = Counter()
        self._closed: set[int] = set()
        self._pruned_below = 0  # closed ids below this were forgotten (settled upstream)
        self._error_log: list[dict[str, Any]] = []  # since the last yielded group
        self._drops: Counter[str] = Counter()
        self._tag_drops: dict[str, Counter[str]] = {}
        self._group_drops: Counter[str] = Counter()  # groups dropped since one was kept
        self.total_drops: Counter[str] = Counter()  # since the last reset; for progress displays
        self.total_tag_drops: dict[str, Counter[str]] = {}  # the same, by env tag
        self._runs.restart()

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
        self._error_log = [dict(e) for e in initial_state.get("error_log", [])]
        tag_drops = initial_state.get("tag_drops", {})
        self._tag_drops = {tag: Counter(counts) for tag, counts in tag_drops.items()}

    def get_state(self) -> dict[str, Any]:
        return {
            "source": self.source.state_dict(),
            "members": {g: [t.to_state() for t in ts] for g, ts in self._members.items()},
            "errors": dict(self._errors),
            "closed": sorted(self._closed),
            "drops": dict(self._drops),
            "error_log": [dict(e) for e in self._error_log],
            "tag_drops": {tag: dict(counts) for tag, counts in self._tag_drops.items()},
        }

    def _close(self, group_id: int, drop_reason: str | None, tag: str) -> None:
        """No more members of this group are wanted; replace it if it was dropped."""
        self._closed.add(group_id)
        members = self._members.pop(group_id, [])
        self._errors.pop(group_id, None)
        if drop_reason is not None:
            self._waste(members, tag)
        if self.signals is not None:
            if self.redundancy or drop_reason is not None:
                self.signals.cancel_group(group_id)
            if drop_reason is not None:
                self.signals.retire(group_id)  # it leaves the ledger of live groups
                self.signals.request_groups(1)
        if drop_reason is not None:
            self._drop(drop_reason, tag)
            self._group_drops[drop_reason] += 1
            if sum(self._group_drops.values()) >= self.max_drops_in_a_row:
                raise self._starved()

    def _starved(self, run: ErrorRun | None = None) -> RuntimeError:
        """The error that ends the stream: too many drops in a row, or a ``run`` of errors."""
        return RuntimeError(
            starved_message(
                self._group_drops,
                self._error_log,
                redundancy=self.redundancy,
                keep_group=self.keep_group,
                drop_group=self.drop_group,
                staleness=self.max_staleness,
                max_drops_in_a_row=self.max_drops_in_a_row,
                run=run,
            )
        )

    @property
    def pending_drops(self) -> dict[str, int]:
        """Drops not yet reported on a yielded group (those after the last one)."""
        return dict(self._drops)

    @property
    def pending_tag_drops(self) -> dict[str, dict[str, int]]:
        """``pending_drops`` split by env tag."""
        return {tag: dict(counts) for tag, counts in self._tag_drops.items()}

    def _drop(self, reason: str, tag: str, n: int = 1) -> None:
        self._drops[reason] += n
        self._tag_drops.setdefault(tag, Counter())[reason] += n
        self.total_drops[reason] += n
        self.total_tag_drops.setdefault(tag, Counter())[reason] += n

    def _waste(self, trajectories: list[Trajectory], tag: str) -> None:
        """Count the generated tokens of dropped trajectories (``dropped/wasted_tokens``)."""
        tokens = sum(t.num_generated_tokens + t.aborted_tokens for t in trajectories)
        if tokens:
            self._drop("wasted_tokens", tag, tokens)

    def _is_stale(self, group: Group) -> bool:
        if self.max_staleness is None or self.current_version is None:
            return False
        return is_stale(group, self.current_version(), self.max_staleness)

    def _rejected(self, group: Group) -> bool:
        if self.keep_group is not None and not self.keep_group(group):
            return True
        return self.drop_group is not None and bool(self.drop_group(group))

    def _log_error(self, traj: Trajectory) -> None:
        self._error_log.append(error_entry(traj))
        del self._error_log[:-MAX_ERRORS_KEPT]
        run = self._runs.errored(traj)
        if run is not None:
            raise self._starved(run)

    def _forget_settled(self) -> None:
        """Forget closed ids no member of which can arrive any more (bounded memory)."""
        settled = self.signals.settled_below if self.signals is not None else 0
        if settled > self._pruned_below:
            self._closed = {g for g in self._closed if g >= settled}
            self._pruned_below = settled

    def _add(self, traj: Trajectory) -> Group | None:
        gid, tag = traj.group_id, traj.tag
        if traj.end_reason == "error":
            self._log_error(traj)
        elif traj.turns:
            self._runs.usable(tag)
        if gid in self._closed:
            late = "errored_trajectories" if traj.end_reason == "error" else "redundant"
            self._drop(late, tag)
            self._waste([traj], tag)
            return None
        if traj.end_reason == "error" or not traj.turns:
            # an env error, or no turn at all (first prompt over max_length): no row to train on
            failure = "errored" if traj.end_reason == "error" else "empty"
            self._drop(f"{failure}_trajectories", tag)
            self._waste([traj], tag)
            self._errors[gid] += 1
            if self._errors[gid] > self.redundancy:
                self._close(gid, failure, tag)
            return None
        members = self._members.setdefault(gid, [])
        members.append(traj)
        if len(members) < self.group_size:
            return None
        group = Group(group_id=gid, trajectories=tuple(members))
        if self._is_stale(group):
            self._close(gid, "stale", tag)
            return None
        if self._rejected(group):
            self._close(gid, "filtered", tag)
            return None
        self._close(gid, None, tag)
        self._group_drops.clear()
        drops, self._drops = dict(self._drops), Counter()
        tag_drops = {t: dict(counts) for t, counts in self._tag_drops.items()}
        self._tag_drops = {}
        errors, self._error_log = self._error_log, []
        return Group(gid, group.trajectories, drops=drops, tag_drops=tag_drops, errors=errors)

    def next(self) -> Group:
        while True:
            try:
                traj = next(self.source)
            except StopIteration:
                for members in self._members.values():
                    self._drop("incomplete", members[0].tag)
                    self._waste(members, members[0].tag)
                self._members.clear()
                raise
            group = self._add(traj)
            self._forget_settled()
            if group is not None:
                return group
