"""Eager awaits: run a coroutine up to its first wait before arming a timer for it.

An env's ``async def step`` often returns without waiting on anything (``ToolEnv``'s
tool turns): an ``asyncio.timeout`` around it costs ~8 µs a call, for a timer that can
never fire (the loop runs no timer until the coroutine waits). :func:`started` runs the
coroutine's first step at once, as Python 3.12's eager tasks do; only a coroutine that
waits is then awaited, under its timer, from where it stopped: :class:`Resumed` hands
the task the future the coroutine waits on and passes on what the task sends or throws
(a cancellation), as ``await`` does.

Examples:
    >>> import asyncio
    >>> async def at_once():
    ...     return 1
    >>> async def later():
    ...     await asyncio.sleep(0)
    ...     return 2
    >>> started(at_once())
    (True, 1)
    >>> done, rest = started(later())
    >>> done, asyncio.run(asyncio.wait_for(rest, 1))
    (False, 2)
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine, Generator
from typing import Any

__all__ = ["Resumed", "started"]


def started(awaitable: Any) -> tuple[bool, Any]:
    """``(True, result)`` when ``awaitable`` is a coroutine that returned without waiting;
    else ``(False, rest)``, ``rest`` to be awaited for the result (the coroutine from
    where it waits, or any other awaitable as it is). The coroutine's exception, raised
    before it waits, is raised here."""
    if not inspect.iscoroutine(awaitable):
        return False, awaitable
    try:
        waiting = awaitable.send(None)
    except StopIteration as stop:
        return True, stop.value
    return False, Resumed(awaitable, waiting)


class Resumed:
    """The rest of a coroutine stopped at its first wait (on ``waiting``), to await."""

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any) -> None:
        self._coro, self._waiting = coro, waiting

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, waiting = self._coro, self._waiting
        while True:
            try:
                sent = yield waiting  # the task waits on what the coroutine waits on
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # thrown by the task (a cancellation): passed on
                try:
                    waiting = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    waiting = coro.send(sent)
                except StopIteration as stop:
                    return stop.value
