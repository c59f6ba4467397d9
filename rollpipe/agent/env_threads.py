"""EnvThreads: worker threads for blocking env calls, each call with a time limit.

A ``TextEnv`` whose ``reset`` / ``step`` may block (any env that does not declare
``blocking = False``) must not run on the event loop that drives generation: one slow
call would stall every episode and the engine. ``EnvThreads.call`` runs it on a worker
thread and awaits the result on the loop. The limit is timed on the loop from the moment
a worker picks the call up (time queued does not count), with the loop's own timer:
nothing polls.

A call over its limit fails its episode with :class:`EnvTimeoutError`; the worker stuck
in it is *abandoned*: a fresh worker takes its place (so a hung env costs one thread, not
capacity), and the stuck thread ends as soon as the call returns. ``on_return`` callbacks
run on the loop once a call has really returned, so an env whose call outlived its
episode (timed out, or the episode was cancelled) is reused only after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EnvLease", "EnvThreads", "EnvTimeoutError"]


class EnvTimeoutError(TimeoutError):
    """An env call did not return within its time limit (``env_timeout_s``)."""


class _Call:
    """One env call: run on a worker, settled on its loop."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float | None):
        self.fn, self.args, self.timeout = fn, args, timeout
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[Any] = self.loop.create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.started_at = 0.0
        self.finished = False  # fn returned (set by the worker, under the pool's lock)
        self.returned = False  # settled on the loop
        self.on_return: list[Callable[[], None]] = []
        self.abandoned = False  # timed out (or cancelled while queued)
        self.worker: threading.Thread | None = None

    # -- on the loop -------------------------------------------------------------------
    def started(self, on_timeout: Callable[[_Call], None]) -> None:
        if self.timeout is not None and not self.returned:
            self.timer = self.loop.call_later(self.timeout, on_timeout, self)

    def settle(self, result: Any, error: BaseException | None) -> None:
        self.returned = True
        if self.timer is not None:
            self.timer.cancel()
        if not self.future.done():
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)
        callbacks, self.on_return = self.on_return, []
        for callback in callbacks:
            callback()


class EnvThreads:
    """Up to ``max_threads`` busy workers for blocking env calls (started on demand)."""

    def __init__(self, max_threads: int, name: str = "rollpipe-env") -> None:
        self.max_threads = max_threads
        self.name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set[threading.Thread] = set()  # alive and not abandoned
        self._idle = 0  # workers waiting for a call
        self._waiting = 0  # calls queued, not yet picked up
        self._closed = False
        self.timeouts = 0  # calls abandoned since construction

    async def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        on_return: Callable[[], None] | None = None,
    ) -> Any:
        """``fn(*args)`` on a worker; :class:`EnvTimeoutError` after ``timeout`` seconds.

        ``on_return`` runs on the loop once ``fn`` has returned (at once if the call
        never started), even when this coroutine was cancelled or timed out meanwhile.
        """
        call = _Call(fn, args, timeout)
        if on_return is not None:
            call.on_return.append(on_return)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the env threads were closed")
            self._waiting += 1
            if self._waiting > self._idle and len(self._workers) < self.max_threads:
                self._start_worker()
        self._queue.put(call)
        try:
            return await asyncio.shield(call.future)
        except asyncio.CancelledError:
            with self._lock:
                skipped = not call.started_at
                call.abandoned = call.abandoned or skipped
            if skipped:  # still queued: the worker will skip it
                call.future.cancel()
                call.settle(None, None)
            call.future.add_done_callback(_retrieve)
            raise

    def _start_worker(self) -> None:  # under the lock
        thread = threading.Thread(target=self._work, name=self.name, daemon=True)
        self._workers.add(thread)
        thread.start()

    def _timed_out(self, call: _Call) -> None:
        """On the loop: the call is over its limit. Fail it and refill its worker's place
        (unless the call finished meanwhile: then its worker stays and its result counts)."""
        with self._lock:
            if call.finished:
                return
            call.abandoned = True
            self._workers.discard(call.worker)  # type: ignore[arg-type]
            if self._waiting > self._idle and not self._closed:
                self._start_worker()
        self.timeouts += 1
        if not call.future.done():
            elapsed = time.monotonic() - call.started_at
            call.future.set_exception(
                EnvTimeoutError(f"no return within {call.timeout} s (waited {elapsed:.2f} s)")
            )

    # -- on a worker -------------------------------------------------------------------
    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                self._idle += 1
            call = self._queue.get()
            with self._lock:
                self._idle -= 1
                if call is None:
                    self._workers.discard(me)
                    return
                self._waiting -= 1
                if call.abandoned:  # cancelled while queued
                    continue
                call.started_at = time.monotonic()
                call.worker = me
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                call.loop.call_soon_threadsafe(call.started, self._timed_out)
            result, error = None, None
            try:
                result = call.fn(*call.args)
            except BaseException as exc:  # the env's failure, given to the episode
                error = exc
            with self._lock:
                call.finished = True
                leave = call.abandoned  # timed out: another worker took this one's place
            with contextlib.suppress(RuntimeError):
                call.loop.call_soon_threadsafe(call.settle, result, error)
            if leave:
                return

    # -- lifecycle ---------------------------------------------------------------------
    def close(self, timeout: float = 0.5) -> bool:
        """Stop the workers: idle ones end at once, busy ones after their call. Waits up to
        ``timeout`` s and returns whether every worker ended (a hung call's does later)."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for _ in workers:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in workers:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in workers)


class EnvLease:
    """An env checked out by one episode, given back (``give_back()``, on the loop) once
    the episode has ended *and* no call of the env still runs on a worker thread."""

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back: Callable[[], None] | None = give_back
        self._running = 0
        self._ended = False

    def call_started(self) -> None:
        self._running += 1

    def call_returned(self) -> None:
        self._running -= 1
        self._maybe_give_back()

    def end(self) -> None:
        """The episode is over (finished, failed or cancelled)."""
        self._ended = True
        self._maybe_give_back()

    def _maybe_give_back(self) -> None:
        if self._ended and self._running == 0 and self._give_back is not None:
            give_back, self._give_back = self._give_back, None
            give_back()


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a result nobody awaits any more as seen (no "never retrieved" warning)."""
    if not future.cancelled():
        future.exception()
