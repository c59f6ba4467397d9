"""Each env its own copy of the process-wide ``random`` state.

gem and TextArena seed and draw from Python's global generator (``random.seed(seed)`` in
``reset``, ``random.randint`` in ``step``). Episodes run concurrently on env threads, so
one env's draws would depend on what the others drew in between, and a seed would no
longer fix an episode. ``PrivateRandom.active()`` swaps this env's state in for the
length of one call, under one process-wide lock, and swaps the caller's back after.

``numpy.random``'s global state is not swapped: no gem game and no single-player
TextArena game draws from it (gem only seeds it), and swapping it would cost ~70 µs a
call against ~10 µs for ``random``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LOCK = threading.Lock()  # one global state: one call at a time may own it


class PrivateRandom:
    """The global ``random`` state one env sees; the rest of the process never sees it."""

    def __init__(self) -> None:
        self._state: Any = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the body with this env's state as the global one (seeded inside it,
        e.g. by the ecosystem's ``reset(seed)``); restore the caller's state after."""
        with _LOCK:
            outer = random.getstate()
            if self._state is not None:
                random.setstate(self._state)
            try:
                yield
            finally:
                self._state = random.getstate()
                random.setstate(outer)
