"""Each env its own copy of the process-wide ``random`` / ``numpy.random`` state.

gem and TextArena seed and draw from the global generators (``random.seed(seed)`` in
``reset``, ``random.randint`` in ``step``). Episodes run concurrently on env threads, so
one env's draws would depend on what the others drew in between, and a seed would no
longer fix an episode. ``PrivateRandom.active()`` swaps this env's state in for the
length of one call, under one process-wide lock, and swaps the caller's back after.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

_LOCK = threading.Lock()  # one global state: one call at a time may own it


class PrivateRandom:
    """The global random state one env sees; the rest of the process never sees it."""

    def __init__(self) -> None:
        self._python: Any = None
        self._numpy: Any = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the body with this env's state as the global one (seeded inside it,
        e.g. by the ecosystem's ``reset(seed)``); restore the caller's state after."""
        with _LOCK:
            outer = random.getstate(), np.random.get_state()
            if self._python is not None:
                random.setstate(self._python)
                np.random.set_state(self._numpy)
            try:
                yield
            finally:
                self._python, self._numpy = random.getstate(), np.random.get_state()
                random.setstate(outer[0])
                np.random.set_state(outer[1])
