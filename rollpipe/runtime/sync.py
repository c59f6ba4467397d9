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

__all__ = ["Gate", "Signal", "fresh_error"]

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


def fresh_error(error: BaseException) -> BaseException:
    """A copy of ``error`` to raise once more (a shared instance would pile up tracebacks)."""
    try:
        clone = copy.copy(error)
    except Exception:  # an exception type that cannot be copied: raise the original
        return error
    clone.__cause__, clone.__context__ = error.__cause__, error.__context__
    return clone.with_traceback(None)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(fresh_error(error))


def _wake(waiters: list[_Waiter], error: BaseException | None) -> None:
    """Resolve each waiter's future on its own loop (the loop may be this thread's)."""
    try:
        current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    for loop, future in waiters:
        if loop is current:
            loop.call_soon(_resolve, future, error)
        else:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future, error)


def _add_waiter(waiters: list[_Waiter]) -> _Waiter:
    """A future on the running loop, listed in ``waiters`` (call under the owner's lock)."""
    loop = asyncio.get_running_loop()
    waiter = (loop, loop.create_future())
    waiters.append(waiter)
    return waiter


def _forget(waiter: _Waiter, waiters: list[_Waiter]) -> None:
    """Unlist a waiter that was cancelled before it was woken (under the owner's lock)."""
    if not waiter[1].done():
        with contextlib.suppress(ValueError):
            waiters.remove(waiter)


class Gate:
    """Open or closed; ``fail(error)`` releases every waiter, now and later, with ``error``.

    ``wait()`` blocks a thread and ``await wait_async()`` suspends a coroutine until the
    gate is open; both raise the failure once the gate has failed.
    """

    def __init__(self, is_open: bool = True) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._open = is_open
        self._error: BaseException | None = None
        self._waiters: list[_Waiter] = []

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def error(self) -> BaseException | None:
        """The error the gate failed with, or None."""
        return self._error

    def open(self) -> None:
        with self._cond:
            if self._error is not None or self._open:
                return
            self._open = True
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        _wake(waiters, None)

    def close(self) -> None:
        with self._cond:
            if self._error is None:
                self._open = False

    def fail(self, error: BaseException) -> None:
        """Release every waiter with ``error``; later waits raise it too. The first wins."""
        with self._cond:
            if self._error is not None:
                return
            self._error = error
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        _wake(waiters, error)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until open (True) or ``timeout`` passes (False); raise if failed."""
        with self._cond:
            opened = self._cond.wait_for(lambda: self._open or self._error is not None, timeout)
            if self._error is not None:
                raise fresh_error(self._error)
            return opened

    async def wait_async(self) -> None:
        """Return once the gate is open; raise if it failed."""
        with self._cond:
            if self._error is not None:
                raise fresh_error(self._error)
            if self._open:
                return
            waiter = _add_waiter(self._waiters)
        try:
            await waiter[1]
        finally:
            with self._cond:
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
        _wake(waiters, None)

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
