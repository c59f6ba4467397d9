"""The ranks of an engine pool and the table that routes requests to them.

A ``Rank`` is one engine on a set of devices. The ``RankTable`` holds every rank's state
(active or out, in-flight requests and tokens, the sessions routed to it) under one
lock: requests are routed, released and re-sent through it, and shrink / expand change
it. ``check_devices`` / ``ranks_to_shrink`` / ``ranks_to_expand`` turn ROLL's
``target_gpus`` into ranks (shrink: every rank touching them; expand: every rank lying
within them), failing before anything changes."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import attrs

from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import EngineClosedError, EngineError
from rollpipe.engines.routing import RankLoad, Route, Router
from rollpipe.engines.state import EngineState

__all__ = [
    "Rank",
    "RankTable",
    "check_devices",
    "pool_devices",
    "ranks_to_expand",
    "ranks_to_shrink",
]


@attrs.define(eq=False)
class Rank:
    """One engine of the pool. ``engine`` is None while offloaded (freed)."""

    index: int
    devices: frozenset[int]
    engine: Engine | None
    active: bool = True
    requests: int = 0  # in flight through the pool
    tokens: int = 0  # prompt + max_tokens of those requests
    resent: int = 0  # its requests re-sent elsewhere since it last left the pool
    sessions: weakref.WeakSet[Route] = attrs.field(factory=weakref.WeakSet)
    error: BaseException | None = None  # why it left the pool, if it failed

    def describe(self) -> str:
        return f"rank {self.index} (devices {sorted(self.devices)})"


def pool_devices(devices: Sequence[Iterable[int]] | None, n: int) -> list[frozenset[int]]:
    """Each rank's device ids: the given ones (disjoint, non-empty) or logical ``[i]``."""
    if devices is None:
        return [frozenset([i]) for i in range(n)]
    sets = [frozenset(_ints(d, f"EnginePool.devices[{i}]")) for i, d in enumerate(devices)]
    if len(sets) != n:
        raise ValueError(f"EnginePool.devices has {len(sets)} entries for {n} engines")
    for i, s in enumerate(sets):
        if not s:
            raise ValueError(f"EnginePool.devices[{i}] is empty; give each rank its device ids")
        for j in range(i):
            if s & sets[j]:
                raise ValueError(
                    f"EnginePool.devices[{i}] and [{j}] share devices {sorted(s & sets[j])}; "
                    "a device belongs to one rank"
                )
    return sets


def _ints(values: Any, what: str) -> list[int]:
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{what} must be a list of device ids, got {values!r}") from None
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{what}: device ids are ints >= 0, got {v!r} in {items}")
    return items


def check_devices(target_gpus: Any, known: frozenset[int], op: str) -> frozenset[int]:
    """``target_gpus`` as a set, or ValueError: empty, duplicates, unknown ids."""
    items = _ints(target_gpus, f"{op}: target_gpus")
    if not items:
        raise ValueError(f"{op}: target_gpus is empty; pass the device ids, e.g. [1]")
    if len(set(items)) != len(items):
        dupes = sorted({v for v in items if items.count(v) > 1})
        raise ValueError(f"{op}: target_gpus has duplicates {dupes} in {items}")
    unknown = sorted(set(items) - known)
    if unknown:
        raise ValueError(f"{op}: unknown devices {unknown}; the pool's devices are {sorted(known)}")
    return frozenset(items)


def ranks_to_shrink(ranks: Sequence[Rank], targets: frozenset[int]) -> list[Rank]:
    """Every rank whose devices touch ``targets``; all must be active, one must stay."""
    chosen = [r for r in ranks if r.devices & targets]
    out = [r.describe() for r in chosen if not r.active]
    if out:
        raise ValueError(f"shrink_sampler: {', '.join(out)} already out of the pool")
    if all(not r.active or r in chosen for r in ranks):
        raise ValueError(
            f"shrink_sampler: devices {sorted(targets)} would take out every active rank "
            f"({', '.join(r.describe() for r in chosen)}); keep at least one generating"
        )
    return chosen


def ranks_to_expand(ranks: Sequence[Rank], targets: frozenset[int]) -> list[Rank]:
    """Every rank whose devices lie within ``targets``; all must be out."""
    chosen = [r for r in ranks if r.devices <= targets]
    if not chosen:
        raise ValueError(
            f"expand_sampler: no rank lies within devices {sorted(targets)}; ranks: "
            + ", ".join(r.describe() for r in ranks)
        )
    already = [r.describe() for r in chosen if r.active]
    if already:
        raise ValueError(f"expand_sampler: {', '.join(already)} already in the pool")
    return chosen


class RankTable:
    """Every rank's state, changed only under one lock; once the pool's ``state`` is
    closed it refuses new requests."""

    def __init__(
        self, ranks: list[Rank], router: Router, log_size: int, state: EngineState
    ) -> None:
        self.ranks = ranks
        self.router = router
        self.state = state
        self.lock = threading.Lock()
        self._released = threading.Condition(self.lock)  # a request left a rank
        self.routing_log: deque[tuple[Hashable | None, int]] = deque(maxlen=log_size)
        self.rerouted = 0  # requests re-sent because their rank left the pool

    @property
    def closed(self) -> bool:
        return self.state.closed

    def loads(self) -> list[RankLoad]:
        with self.lock:
            return [RankLoad(r.index, r.requests, r.tokens) for r in self.ranks if r.active]

    def active_engines(self) -> list[Engine]:
        with self.lock:
            return [r.engine for r in self.ranks if r.active and r.engine is not None]

    # -- requests ------------------------------------------------------------------------
    def pick(self, session: Route | None, cost: int) -> tuple[Rank, Engine]:
        """Route one request (``cost``: its prompt + max_tokens) and count it in flight."""
        with self.lock:
            if self.closed:
                raise EngineClosedError("EnginePool is closed; create a new pool")
            active = [r for r in self.ranks if r.active]
            if not active:
                failed = {r.index: r.error for r in self.ranks if r.error is not None}
                raise EngineError(f"EnginePool: no active rank left (failed: {failed})")
            loads = [RankLoad(r.index, r.requests, r.tokens) for r in active]
            index = self.router.route(session, loads)
            if index not in {r.index for r in active}:
                raise ValueError(f"EnginePool: router picked rank {index!r}, not an active one")
            rank = self.ranks[index]
            rank.requests += 1
            rank.tokens += cost
            if session is not None:
                session.rank = index
                rank.sessions.add(session)
            self.routing_log.append((None if session is None else session.key, index))
            assert rank.engine is not None  # active ranks have an engine
            return rank, rank.engine

    def release(self, rank: Rank, cost: int) -> None:
        with self.lock:
            rank.requests -= 1
            rank.tokens -= cost
            self._released.notify_all()

    def resent_if_left(self, rank: Rank, engine: Engine) -> bool:
        """An aborted request: re-send it (True) if its rank left the pool meanwhile."""
        with self.lock:
            if rank.active and rank.engine is engine:
                return False
            self._count_resend(rank)
            return True

    def left_or_failed(self, rank: Rank, engine: Engine) -> bool:
        """After an EngineError from ``engine``: True to re-send the request elsewhere
        (its rank left, or its engine died and the rank is taken out now); False when
        it is the request's own error (or the pool closed): the caller gets it."""
        with self.lock:
            if self.closed:
                return False
            if rank.active and rank.engine is engine:
                if getattr(engine, "alive", True):
                    return False  # e.g. a prompt too long for the engine
                rank.active = False
                rank.error = EngineError(f"{rank.describe()}: its engine died")
                _clear_routes(rank)
            self._count_resend(rank)
            return any(r.active for r in self.ranks)

    def failed_during_update(self, engine: Engine, error: BaseException) -> bool:
        """After ``engine.update_weights`` raised ``error``: True if its engine is dead and
        its rank is taken out now with some rank left (the update goes on), else False."""
        with self.lock:
            if self.closed or getattr(engine, "alive", True):
                return False
            for rank in self.ranks:
                if rank.active and rank.engine is engine:
                    rank.active = False
                    rank.error = EngineError(f"{rank.describe()}: its engine died: {error}")
                    _clear_routes(rank)
            return any(r.active for r in self.ranks)

    def _count_resend(self, rank: Rank) -> None:
        rank.resent += 1
        self.rerouted += 1

    # -- shrink / expand ---------------------------------------------------------------
    def take_out(self, targets: frozenset[int]) -> tuple[list[Rank], int, list[Engine]]:
        """Shrink's change: the chosen ranks, the sessions remapped, their engines."""
        with self.lock:
            chosen = ranks_to_shrink(self.ranks, targets)
            remapped, engines = 0, []
            for rank in chosen:
                rank.active, rank.resent = False, 0
                remapped += _clear_routes(rank)
                if rank.engine is not None:
                    engines.append(rank.engine)
                rank.engine = None
            return chosen, remapped, engines

    def wait_released(self, ranks: Sequence[Rank], timeout: float) -> int:
        """Wait until nothing is in flight on ``ranks``; their requests re-sent meanwhile."""
        with self._released:
            self._released.wait_for(lambda: all(r.requests == 0 for r in ranks), timeout)
            return sum(r.resent for r in ranks)

    def to_expand(self, targets: frozenset[int]) -> list[Rank]:
        with self.lock:
            return ranks_to_expand(self.ranks, targets)

    def put_back(self, built: Sequence[tuple[Rank, Engine]]) -> None:
        with self.lock:
            for rank, engine in built:
                rank.engine, rank.active, rank.error = engine, True, None

    def close(self) -> list[Engine]:
        """Close the pool's state, refusing new requests; the engines left to close."""
        with self.lock:
            self.state.close()
            return [r.engine for r in self.ranks if r.engine is not None]


def _clear_routes(rank: Rank) -> int:
    """Forget the sessions routed to ``rank``; how many pointed at it."""
    cleared = 0
    for session in list(rank.sessions):
        if session.rank == rank.index:
            session.rank = None
            cleared += 1
    rank.sessions = weakref.WeakSet()
    return cleared
