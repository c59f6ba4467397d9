"""shutdown_within: stop a thread pool without waiting for ever on a call that blocks."""

from __future__ import annotations

import concurrent.futures
import time


def shutdown_within(pool: concurrent.futures.ThreadPoolExecutor, timeout: float) -> bool:
    """Cancel queued work, then give the pool's threads up to ``timeout`` seconds to end.

    Idle threads end at once; one still inside a call (an env step that blocks) is left
    to end when the call returns. Returns whether every thread ended in time.
    """
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + timeout
    threads = list(getattr(pool, "_threads", ()))  # ThreadPoolExecutor keeps its threads here
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)
