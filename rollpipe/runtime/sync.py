"""Thread-safe waits without polling: a ``Gate`` (open/closed/failed) and a ``Signal`` (wake-up).

Both may be changed from any thread and waited on from threads (``Gate.wait``) or from
coroutines on any event loop (``wait_async`` / ``Signal.wait``). A waiting coroutine is
woken through its own loop's ``call_soon_threadsafe``, so neither needs to know a loop in
advance, and nothing sleeps in a loop to find out that something changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from collections.abc import Callable

__all__ = ["Gate", "Listeners", "Signal", "fresh_error"]

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


def fresh_error(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise once more (a shared instance would pile up tracebacks)."""
    try:
        clone = copy.copy(error)
    except Exception:  # an exception type that cannot be copied: raise the original
        return error
    clone.__cause__, clone.__context__ = error.__cause__, error.__context__
    return clone.with_traceback(None)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a cancelled waiter stays cancelled
        future.set_result(None)


def _wake(waiters: list[_Waiter]) -> None:
    """Resolve each waiter's future on its own loop (the loop may be this thread's)."""
    try:
        current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    for loop, future in waiters:
        if loop is current:
            loop.call_soon(_resolve, future)
        else:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future)


def _add_waiter(waiters: list[_Waiter]) -> _Waiter:
    """A future on the running loop, listed in ``waiters`` (call under the owner's lock)."""
    loop = asyncio.get_running_loop()
    waiter = (loop, loop.create_future())
    waiters.append(waiter)
    return waiter


def _forget(waiter: _Waiter, waiters: list[_Waiter]) -> None:
    """Unlist a waiter whose wait ended (under the owner's lock). A woken one is already
    unlisted (the wake took the whole list); a cancelled one is not, and would stay listed
    until the next wake-up: memory that grows with every cancelled wait on a closed gate."""
    with contextlib.suppress(ValueError):
        waiters.remove(waiter)


class Gate:
    """Open or closed; ``await wait_async()`` suspends a coroutine, on any event loop, until
    the gate is open. ``open()`` and ``close()`` may come from any thread."""

    def __init__(self, is_open: bool = True) -> None:
        self._lock = threading.Lock()
        self._open = is_open
        self._waiters: list[_Waiter] = []

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        with self._lock:
            if self._open:
                return
            self._open = True
            waiters, self._waiters = self._waiters, []
        _wake(waiters)

    def close(self) -> None:
        with self._lock:
            self._open = False

    async def wait_async(self) -> None:
        """Return once the gate is open."""
        with self._lock:
            if self._open:
                return
            waiter = _add_waiter(self._waiters)
        try:
            await waiter[1]
        finally:
            with self._lock:
                _forget(waiter, self._waiters)


class Signal:
    """A wake-up call: ``notify()`` from any thread wakes the coroutines in ``wait()``.

    A notification with nobody waiting is remembered (once), so a change made between
    two waits is never missed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = False
        self._waiters: list[_Waiter] = []

    def notify(self) -> None:
        with self._lock:
            self._pending = True
            waiters, self._waiters = self._waiters, []
        _wake(waiters)

    async def wait(self) -> None:
        """Return at the first notification since the previous ``wait`` returned."""
        with self._lock:
            if self._pending:
                self._pending = False
                return
            waiter = _add_waiter(self._waiters)
        try:
            await waiter[1]
        finally:
            with self._lock:
                self._pending = False
                _forget(waiter, self._waiters)


class Listeners:
    """Callbacks told of every change of a shared object, from whatever thread made it.

    Each listener must be cheap and thread-safe (typically a ``Signal.notify``); they are
    called outside the lock, so a listener may read the object that changed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def add(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
