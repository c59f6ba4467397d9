"""LoopThread: an asyncio event loop that runs in its own daemon thread.

Engines and the rollout stage each own one, so their coroutines make progress while the
caller's thread trains, and callers on any thread reach them with
``asyncio.run_coroutine_threadsafe``. ``stop()`` cancels what is left and joins.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class LoopThread:
    """An asyncio event loop running forever in a daemon thread (an engine's, a rollout's)."""

    def __init__(self, name: str, init: Callable[[], None] | None = None) -> None:
        self._init = init
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _run(self) -> None:
        if self._init is not None:
            self._init()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self.loop)
            for t in tasks:
                t.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # loop closed meanwhile
            return
        if not self.in_loop_thread():
            self.thread.join(timeout)
