"""Runtime: the one event loop that runs engines and episodes, and the one bridge to it.

An engine runs on a ``Runtime``: an asyncio event loop in one daemon thread. A
``EpisodeRunner``'s episodes run on their engine's runtime too, so a turn's next request reaches
the engine before its next step, with no thread hop. Other threads (the trainer's,
torchdata's) reach the loop only through a ``Scope``: ``submit`` (a future, cancellable)
and ``call`` (block for the result). Each part that calls in (an engine, a rollout, a
pausable stage) holds its own scope; closing the scope fails that part's waiting calls
at once, from the closing thread, even while the loop is busy in a long step — so a
close never leaves a thread waiting. Closing the runtime closes every scope on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rollpipe.runtime.sync import fresh_error

__all__ = ["Runtime", "RuntimeClosedError", "Scope"]

T = TypeVar("T")


class RuntimeClosedError(RuntimeError):
    """The runtime (or the scope a call was made in) was closed."""


class Runtime:
    """An asyncio event loop running in a daemon thread, and the scopes that call into it.

    ``init`` runs first in the new thread (an engine sets its torch threads there).
    """

    def __init__(self, name: str = "rollpipe-runtime", init: Callable[[], None] | None = None):
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._scopes: list[Scope] = []
        self._error: BaseException | None = None
        self._init_error: BaseException | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(init, ready), name=name, daemon=True)
        self.thread.start()
        ready.wait()
        if self._init_error is not None:
            raise self._init_error
        self._own = self.scope(name)

    def _run(self, init: Callable[[], None] | None, ready: threading.Event) -> None:
        try:
            if init is not None:
                init()
        except BaseException as e:
            self._init_error = e
            self.loop.close()
            ready.set()
            return
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        try:
            self.loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    # -- state ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Not closed, and the loop thread is running."""
        return self._error is None and self.thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What the runtime was closed with (None while open)."""
        return self._error

    def in_loop(self) -> bool:
        """Whether the calling thread is the loop's own."""
        return threading.current_thread() is self.thread

    # -- the bridge ------------------------------------------------------------------------
    def scope(self, name: str) -> Scope:
        """A new scope: the calls of one part, failed together when it closes."""
        scope = Scope(self, name)
        with self._lock:
            error = self._error
            if error is None:
                self._scopes.append(scope)
        if error is not None:
            scope.close(error)
        return scope

    def _forget(self, scope: Scope) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._scopes.remove(scope)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop (in the runtime's own scope); see ``Scope.submit``."""
        return self._own.submit(coro)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block for its result; see ``Scope.call``."""
        return self._own.call(coro, timeout)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop from any thread (ignored once it is closed)."""
        if self.in_loop():
            self.loop.call_soon(fn, *args)
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(fn, *args)

    def close(self, error: BaseException | None = None, timeout: float = 5.0) -> None:
        """Fail every waiting call with ``error``, cancel what runs, stop the loop.

        Waits up to ``timeout`` for the thread; a loop blocked in a long call (a blocking
        env step on it) is left to end once that call returns, and no caller waits on it.
        """
        with self._lock:
            if self._error is not None:
                return
            self._error = error or RuntimeClosedError(f"runtime {self.name!r} was closed")
            scopes, self._scopes = self._scopes, []
        for scope in scopes:
            scope.close(self._error)
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_loop():
            self.thread.join(timeout)


class Scope:
    """The calls one part makes into a runtime. ``close(error)`` fails those still waiting.

    Created by ``Runtime.scope``; closed by its owner, or with its runtime.
    """

    def __init__(self, runtime: Runtime, name: str) -> None:
        self.runtime = runtime
        self.name = name
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._error is not None

    def check_open(self) -> None:
        """Raise the closing error if this scope (or its runtime) is closed."""
        error = self._error or self.runtime.error
        if error is not None:
            raise fresh_error(error)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` as a task on the loop; the future holds its result.

        Cancelling the future cancels the task. Closing the scope or the runtime fails
        the future with the closing error and cancels the task.
        """
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            error = self._error or self.runtime.error
            if error is None:
                self._pending.add(future)
        if error is not None:
            coro.close()
            raise fresh_error(error)
        future.add_done_callback(self._discard)
        try:
            self.runtime.loop.call_soon_threadsafe(self._start, coro, future)
        except RuntimeError:  # the loop closed meanwhile
            coro.close()
            closed = RuntimeClosedError(f"runtime {self.runtime.name!r} is closed")
            _settle(future, exception=self.runtime.error or closed)
        return future

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (or exception).

        Must not be called on the loop's own thread: it would wait for itself.
        """
        if self.runtime.in_loop():
            coro.close()
            raise RuntimeError(
                f"{self.name}: this call blocks until the event loop has run it, and it was "
                "made on that loop's own thread; call it from another thread"
            )
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (an env's, a request's)
                return future.result()
            future.cancel()
            raise TimeoutError(f"{self.name}: no result within {timeout} s") from None

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the runtime's loop from any loop (no hop when already on it)."""
        if self.runtime.in_loop():
            try:
                self.check_open()
            except BaseException:
                coro.close()
                raise
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def close(self, error: BaseException | None = None) -> None:
        """Fail every waiting call with ``error`` (idempotent: the first error is kept)."""
        with self._lock:
            if self._error is None:
                self._error = error or RuntimeClosedError(f"{self.name} was closed")
            pending, self._pending = list(self._pending), set()
        for future in pending:
            _settle(future, exception=self._error)
        self.runtime._forget(self)

    # -- on the loop -------------------------------------------------------------------------
    def _start(self, coro: Coroutine[Any, Any, T], future: concurrent.futures.Future[T]) -> None:
        if future.done():  # failed by a close, or cancelled, before it started
            coro.close()
            return
        task = self.runtime.loop.create_task(coro)
        task.add_done_callback(functools.partial(self._copy, future))
        future.add_done_callback(functools.partial(self._cancel, task))

    def _copy(self, future: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
        if future.done():
            return
        if task.cancelled():  # by the loop stopping, or by someone else
            gone = RuntimeClosedError(f"{self.name}: the call was cancelled")
            _settle(future, exception=self._error or self.runtime.error or gone)
        elif (error := task.exception()) is not None:
            _settle(future, exception=error)
        else:
            _settle(future, result=task.result())

    def _cancel(self, task: asyncio.Task[Any], future: concurrent.futures.Future[Any]) -> None:
        if not task.done():
            self.runtime.call_soon(task.cancel)

    def _discard(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)


def _settle(
    future: concurrent.futures.Future[Any],
    *,
    result: Any = None,
    exception: BaseException | None = None,
) -> None:
    """Complete ``future`` unless it already is (a close and a result may race)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exception is not None:
            future.set_exception(fresh_error(exception))
        else:
            future.set_result(result)
