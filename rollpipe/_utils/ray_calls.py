"""call_actor: one way to call a Ray actor's method from the event loop, for every part
that hosts something on Ray (engines, envs).

The call is awaited on the running loop (an ``ObjectRef`` is awaitable), within a time
limit if one is given, and Ray's two failures come back as one of two exceptions that
say which happened: :class:`ActorLost` (the actor died, is unreachable, or never
started) and :class:`ActorRaised` (the hosted object's method raised; ``cause`` is its
own exception). The caller names its own errors from them. A limit that passes raises
``TimeoutError`` (the actor is left as it is: the caller decides whether to kill it).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

__all__ = ["ActorLost", "ActorRaised", "call_actor", "ray_text"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ActorLost(RuntimeError):
    """The actor died or could not be reached during ``method`` (``init_failed``: its
    constructor failed, so no actor of this kind can host the object)."""

    def __init__(self, method: str, error: BaseException) -> None:
        super().__init__(f"{method}(): {ray_text(error)}")
        self.method, self.error = method, error
        self.init_failed = bool(getattr(error, "actor_init_failed", False))


class ActorRaised(RuntimeError):
    """The hosted object's ``method`` raised ``cause`` (its own exception, as it would
    have raised in-process; None where Ray could not carry it over, then ``error`` is
    Ray's own)."""

    def __init__(self, method: str, cause: BaseException | None, error: BaseException) -> None:
        super().__init__(f"{method}() failed: {cause if cause is not None else error}")
        self.method, self.cause, self.error = method, cause, error


def ray_text(error: BaseException) -> str:
    """Ray's message on one line, without its terminal colours."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines()]
    return "; ".join(line for line in lines if line and set(line) != {"^"})


async def call_actor(
    actor: Any, method: str, *args: Any, timeout: float | None = None, **kwargs: Any
) -> Any:
    """``actor.method(*args, **kwargs)`` awaited (see the module doc).

    Examples:
        >>> import asyncio
        >>> async def lost():  # what a caller catches: ActorLost / ActorRaised / TimeoutError
        ...     try:
        ...         return await call_actor(object(), "version")
        ...     except AttributeError as exc:  # not an actor at all: the caller's bug
        ...         return type(exc).__name__
        >>> asyncio.run(lost())
        'AttributeError'
    """
    from ray.exceptions import RayActorError, RayTaskError

    ref = getattr(actor, method).remote(*args, **kwargs)
    try:
        if timeout is None:
            return await ref
        return await asyncio.wait_for(_awaited(ref), timeout)
    except RayActorError as e:  # died, unreachable, or its constructor failed
        raise ActorLost(method, e) from e
    except RayTaskError as e:  # the hosted object raised: its own error
        cause = e.cause if isinstance(e.cause, BaseException) else None
        raise ActorRaised(method, cause, e) from e


async def _awaited(ref: Any) -> Any:
    return await ref
