"""Runs of errors: when an env tag gives nothing but errors, the stream stops early.

Without this, an env that fails every episode only stopped a ``GroupAssembler`` after
``max_drops_in_a_row`` groups (1000 by default): minutes of silent retries. A *run* is
the errored trajectories of one env tag since that tag last gave a usable one (a
trajectory that did not error and has turns). A run ends the stream when it holds
``max_errors_in_a_row`` errors of one kind (the same exception type in the same call),
or when it has lasted ``max_error_seconds`` (since the tag's last usable trajectory, or
since the stream started) with at least ``TIMED_MIN_ERRORS`` errors. A working env never
trips it (its usable trajectories end every run), however slow it is or however many of
its groups a filter rejects: filtered, stale and empty drops are ``max_drops_in_a_row``'s.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from rollpipe.agent.env_errors import error_entry
from rollpipe.agent.records import Trajectory

__all__ = ["TIMED_MIN_ERRORS", "ErrorRun", "ErrorRuns"]

TIMED_MIN_ERRORS = 16
"""Errors a run needs before ``max_error_seconds`` can end it: a slow env that errors now
and then does not give 16 errors in a row (0.3**16 is about 4e-9)."""
QUOTED = 3
"""Errors of a run kept to quote (the most recent)."""


@attrs.frozen
class ErrorRun:
    """A run that ended the stream: its ``tag``, errors per kind (``"TypeError in
    Taskset.step"``), how long it lasted, the rule that ended it (``"max_errors_in_a_row=64"``)
    and the last ``QUOTED`` ``error_entry`` dicts."""

    tag: str
    kinds: Mapping[str, int]
    seconds: float
    rule: str
    errors: tuple[Mapping[str, Any], ...]


@attrs.define
class _Run:
    since: float
    kinds: Counter[str] = attrs.Factory(Counter)
    errors: deque[dict[str, Any]] = attrs.Factory(lambda: deque(maxlen=QUOTED))


def error_kind(traj: Trajectory) -> str:
    """``"TypeError in Taskset.step"``: the exception type and the call it came from."""
    return f"{traj.error_type or 'error'} in {traj.error_call or 'the episode'}"


class ErrorRuns:
    """The runs of errors of each env tag (see the module doc); ``clock`` is the time in
    seconds (``time.monotonic``; a test passes its own)."""

    def __init__(
        self,
        max_errors_in_a_row: int,
        max_error_seconds: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_errors_in_a_row = max_errors_in_a_row
        self.max_error_seconds = max_error_seconds
        self.clock = clock
        self.restart()

    def restart(self) -> None:
        """Forget every run; the stream starts now."""
        self._started = self.clock()
        self._last_usable: dict[str, float] = {}
        self._runs: dict[str, _Run] = {}

    def usable(self, tag: str) -> None:
        """``tag`` gave a usable trajectory: its run ends."""
        self._runs.pop(tag, None)
        self._last_usable[tag] = self.clock()

    def errored(self, traj: Trajectory) -> ErrorRun | None:
        """Count ``traj``'s error in its tag's run; the run if it must end the stream."""
        tag = traj.tag
        now = self.clock()
        run = self._runs.get(tag)
        if run is None:
            run = self._runs[tag] = _Run(self._last_usable.get(tag, self._started))
        kind = error_kind(traj)
        run.kinds[kind] += 1
        run.errors.append(error_entry(traj))
        rule = self._broken_rule(run, kind, now)
        if rule is None:
            return None
        kinds = dict(run.kinds.most_common())
        return ErrorRun(tag, kinds, now - run.since, rule, tuple(run.errors))

    def _broken_rule(self, run: _Run, kind: str, now: float) -> str | None:
        """The rule ``run`` breaks, as the message names it, or None."""
        if run.kinds[kind] >= self.max_errors_in_a_row:
            return f"max_errors_in_a_row={self.max_errors_in_a_row}"
        limit = self.max_error_seconds
        enough = run.kinds.total() >= TIMED_MIN_ERRORS
        if limit is not None and enough and now - run.since >= limit:
            return f"max_error_seconds={limit:g}"
        return None
