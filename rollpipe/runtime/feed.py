"""Feed: items made one after another on a thread, handed to a coroutine as they come.

A ``EpisodeRunner`` pulls a wave of episode specs from its upstream node on the source
thread. One job per item (an executor future and a loop wake-up each) cost more than
the episode's own turns when a thousand episodes start at once; a ``Feed`` runs the
whole wave as one job and hands the items over through a deque, waking the loop only
when it waits for one (``Signal``). An item that takes long holds back only the items
after it.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from rollpipe.runtime.sync import Signal

__all__ = ["Feed"]

T = TypeVar("T")
_DONE = object()


class Feed(Generic[T]):
    """Up to ``n`` calls of ``make()`` on ``executor``, in order; ``await next()`` gives
    each result as it comes, then None. It stops early after an item for which
    ``last(item)`` is true, or after ``stop()``; an exception ``make`` raised is raised
    by ``next`` in its place (and ends the feed)."""

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        make: Callable[[], T],
        n: int,
        last: Callable[[T], bool] = lambda item: False,
    ) -> None:
        self._items: deque[object] = deque()
        self._arrived = Signal()
        self._stopped = False
        self._job = executor.submit(self._run, make, n, last)

    def _run(self, make: Callable[[], T], n: int, last: Callable[[T], bool]) -> None:
        """On the executor's thread: make the items, hand each over at once."""
        try:
            for _ in range(n):
                if self._stopped:
                    return
                item = make()
                self._items.append(item)
                self._arrived.notify()  # wakes the loop only if it waits
                if last(item):
                    return
        except BaseException as error:  # the consumer raises it
            self._items.append(error)
        finally:
            self._items.append(_DONE)
            self._arrived.notify()

    async def next(self) -> T | None:
        """The next item, or None once there are no more."""
        while not self._items:
            await self._arrived.wait()
        item = self._items.popleft()
        if item is _DONE:
            self._items.appendleft(_DONE)  # over: every later call says so too
            return None
        if isinstance(item, BaseException):
            self._items.clear()
            self._items.append(_DONE)
            raise item
        return item  # type: ignore[return-value]

    def stop(self) -> None:
        """Make no more items (one being made is still handed over)."""
        self._stopped = True
        self._job.cancel()  # not started yet: it never runs
