"""Routing requests across an engine pool: routes, loads and routers.

A :class:`Route` is one conversation's routing key (an episode's, or a front-door
session's): ``run_episode`` makes every request of an episode inside
``in_route(Route(episode_id))``, so a pool can keep the episode on the rank that already
holds its prefix in its KV cache, as ROLL's env-affinity routing does. The route rides a
``ContextVar``: engines that do not route never see it, and the ``Engine`` protocol is
unchanged. A route remembers its own rank, so the pool keeps no table that grows with
the number of episodes. (It was named ``Session`` before; "session" now means only the
front door's ``AgentSession``.)

A router picks a rank for a request from the active ranks' loads. Built in:
``least_requests`` and ``least_tokens`` (sticky: a session stays on its rank; a new one
goes to the least-loaded rank by in-flight requests or by queued tokens) and ``random``
(no stickiness: the baseline the benchmark compares against).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Hashable, Iterator, Sequence
from contextvars import ContextVar
from typing import Protocol

import attrs

__all__ = [
    "ROUTERS",
    "LeastLoaded",
    "RandomRouter",
    "RankLoad",
    "Route",
    "Router",
    "current_route",
    "in_route",
    "make_router",
]


@attrs.define(eq=False)
class Route:
    """One conversation whose requests should stay on one rank; ``rank`` is where it is
    routed now (None: not yet, or its rank left the pool)."""

    key: Hashable
    rank: int | None = None


_CURRENT: ContextVar[Route | None] = ContextVar("rollpipe_route", default=None)


@contextlib.contextmanager
def in_route(route: Route) -> Iterator[Route]:
    """Requests made inside this block (in this task) belong to ``route``."""
    token = _CURRENT.set(route)
    try:
        yield route
    finally:
        _CURRENT.reset(token)


def current_route() -> Route | None:
    """The route of the request being made, if its caller set one."""
    return _CURRENT.get()


@attrs.frozen
class RankLoad:
    """An active rank as a router sees it: in-flight requests and the tokens they may
    still occupy (prompt + ``max_tokens`` per request)."""

    rank: int
    requests: int
    tokens: int


class Router(Protocol):
    """Picks the rank for one request among ``loads`` (never empty, active ranks only)."""

    def route(self, session: Route | None, loads: Sequence[RankLoad]) -> int: ...


@attrs.frozen
class LeastLoaded:
    """Sticky routing: a session stays on its rank while that rank is active; a new
    session (or a request without one) goes to the least-loaded rank, by ``measure``."""

    measure: str = attrs.field(
        default="requests", validator=attrs.validators.in_(("requests", "tokens"))
    )

    def route(self, session: Route | None, loads: Sequence[RankLoad]) -> int:
        if session is not None and any(load.rank == session.rank for load in loads):
            return session.rank  # type: ignore[return-value]
        best = min(loads, key=lambda load: (getattr(load, self.measure), load.rank))
        return best.rank


@attrs.define
class RandomRouter:
    """Every request to a random active rank (no stickiness), seeded."""

    seed: int = 0
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def route(self, session: Route | None, loads: Sequence[RankLoad]) -> int:
        return self._rng.choice(loads).rank


ROUTERS: tuple[str, ...] = ("least_requests", "least_tokens", "random")


def make_router(router: str | Router) -> Router:
    """A router by name (``ROUTERS``) or the user's own."""
    if not isinstance(router, str):
        if not callable(getattr(router, "route", None)):
            raise TypeError(
                f"EnginePool: router must be one of {ROUTERS} or have a route(session, "
                f"loads) method, got {router!r}"
            )
        return router
    if router == "least_requests":
        return LeastLoaded("requests")
    if router == "least_tokens":
        return LeastLoaded("tokens")
    if router == "random":
        return RandomRouter()
    raise ValueError(f"EnginePool: unknown router {router!r}; use one of {ROUTERS}")
