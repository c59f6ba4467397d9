"""The signals that flow back upstream, against the records.

Records flow one way (specs → trajectories → groups → batches). Three signals flow back:
admission (read from the pipeline's one ``Suspension``: no new episode or engine request
while the trainer updates weights), group cancellations (redundant members no longer
needed) and requests for more groups (the pipeline's grants, and replacements for a
group that was filtered, stale or errored). With ``max_off_policy_strategy="wait"`` they
also hold the ledger of live groups: the policy version each group started at, until the
trainer consumes it or it is dropped (the Batch takes the oldest first). One
``PipelineSignals`` is shared by the stages of a pipeline; each stage that needs it
takes it as an argument, so a stage used alone needs none. A stage that must react to a
signal at once (the rollout's admission driver) registers a listener, called on every
change from whatever thread made it: nothing polls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rollpipe._utils.checks import check_int
from rollpipe.nodes.suspension import Suspension
from rollpipe.runtime import Listeners


class PipelineSignals:
    """Admission, cancelled groups, grants and replacement requests, safe across threads.

    Admission is ``suspension``'s (the pipeline's one ``Suspension``; a fresh one, with
    no engine, when none is given): its changes reach these signals' listeners too.

    Examples:
        >>> signals = PipelineSignals()
        >>> changes = []
        >>> signals.add_listener(lambda: changes.append(1))
        >>> signals.cancel_group(3); signals.request_groups(2); signals.grant_groups(4, step=1)
        >>> signals.is_cancelled(3), signals.take_replacements(), signals.take_grants()
        (True, 2, [(4, 1)])
        >>> signals.suspension.suspend(); print(signals.is_open, len(changes))
        False 4
        >>> signals.suspension.resume(); signals.is_open
        True
    """

    def __init__(self, suspension: Suspension | None = None) -> None:
        self.suspension = suspension if suspension is not None else Suspension()
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()
        self._settled = 0  # no member of a group below this id is left upstream
        self._replacements = 0
        self._grants: list[tuple[int, int]] = []  # (groups, step) not yet taken
        self._made = 0  # replacements + grants ever asked for
        self._started: dict[int, int] = {}  # live group id -> version it started at
        self._listeners = Listeners()
        self.suspension.add_listener(self._listeners.notify)

    # -- listeners --------------------------------------------------------------------
    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change (it must be cheap and thread-safe)."""
        self._listeners.add(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.remove(listener)

    # -- admission (the suspension's) ---------------------------------------------------
    @property
    def is_open(self) -> bool:
        """Whether new episodes and new engine requests may start (not suspended)."""
        return self.suspension.admitting

    async def admit(self) -> None:
        """Return once admitting; awaited before every engine request."""
        await self.suspension.admit()

    # -- cancellations --------------------------------------------------------------
    def cancel_group(self, group_id: int) -> None:
        """Members of ``group_id`` still queued or running are no longer wanted."""
        with self._lock:
            self._cancelled.add(group_id)
        self._listeners.notify()

    def is_cancelled(self, group_id: int) -> bool:
        with self._lock:
            return group_id in self._cancelled

    def cancelled_groups(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._cancelled)

    def settle_below(self, group_id: int) -> None:
        """The rollout has no member of any group below ``group_id`` left (admitted,
        queued or still to be pulled): their cancellations are forgotten, and so may the
        downstream stages' records of them (memory stays bounded on endless streams)."""
        with self._lock:
            if group_id > self._settled:
                self._settled = group_id
                self._cancelled = {g for g in self._cancelled if g >= group_id}

    @property
    def settled_below(self) -> int:
        """See ``settle_below`` (0 until the rollout reports)."""
        return self._settled

    # -- more groups: replacements and grants ------------------------------------------
    def request_groups(self, n: int = 1) -> None:
        """Ask the episode source for ``n`` more groups (to replace dropped ones)."""
        check_int("request_groups: n", n, 0)
        with self._lock:
            self._replacements += n
            self._made += n
        self._listeners.notify()

    def grant_groups(self, n: int, step: int = 0) -> None:
        """Let a metered episode source issue ``n`` more groups, created at training
        ``step``: the one call through which the pipeline grants work (one batch's worth
        per ``get_batch``, so generation does not run ahead; a grant older than the
        source allows expires unissued)."""
        check_int("grant_groups: n", n, 0)
        check_int("grant_groups: step", step, 0)
        with self._lock:
            self._grants.append((n, step))
            self._made += n
        self._listeners.notify()

    @property
    def replacements_pending(self) -> int:
        with self._lock:
            return self._replacements

    @property
    def requests_made(self) -> int:
        """Groups requested or granted since these signals were made (only grows): a source
        that ran dry is worth pulling again once this passes what it was then."""
        with self._lock:
            return self._made

    def take_replacements(self) -> int:
        """Hand all pending replacement requests to the caller (the episode source)."""
        with self._lock:
            n, self._replacements = self._replacements, 0
            return n

    def take_grants(self) -> list[tuple[int, int]]:
        """Hand all pending ``(groups, step)`` grants to the caller (a metered source)."""
        with self._lock:
            grants, self._grants = self._grants, []
            return grants

    # -- the ledger of live groups (wait policy) ---------------------------------------
    def note_started(self, group_id: int, version: int) -> None:
        """The source started ``group_id`` while the policy was at ``version`` (its
        oldest token can be no older)."""
        with self._lock:
            self._started[group_id] = version

    def retire(self, group_id: int) -> None:
        """``group_id`` left the pipeline (consumed by the trainer, or dropped)."""
        with self._lock:
            self._started.pop(group_id, None)

    def started_versions(self) -> dict[int, int]:
        """Live groups (started, not yet consumed or dropped) -> their start version."""
        with self._lock:
            return dict(self._started)

    # -- checkpointing --------------------------------------------------------------
    def get_state(self) -> dict[str, object]:
        with self._lock:
            return {
                "cancelled": sorted(self._cancelled),
                "replacements": self._replacements,
                "grants": [list(g) for g in self._grants],
                "started": sorted([g, v] for g, v in self._started.items()),
            }

    def load_state(self, state: dict[str, object] | None) -> None:
        with self._lock:
            self._settled = 0
            if state is None:
                self._cancelled, self._replacements, self._grants = set(), 0, []
                self._started = {}
            else:
                self._cancelled = set(state["cancelled"])  # type: ignore[call-overload]
                self._replacements = int(state["replacements"])  # type: ignore[call-overload]
                grants = state.get("grants", [])
                self._grants = [(int(n), int(s)) for n, s in grants]  # type: ignore[attr-defined]
                started = state.get("started", [])
                self._started = {int(g): int(v) for g, v in started}  # type: ignore[attr-defined]


UpstreamSignals = PipelineSignals  # old name, kept importable
