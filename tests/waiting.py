"""Waiting on states, not on time: the only place in ``tests/`` that sleeps to wait.

A test that needs "requests are in flight", "the engine is paused" or "the env call is
running" waits for that observable state (tokens produced so far, an engine's counters,
an event) with ``wait_until`` / ``wait_until_async``. Their timeout is a deadline: on a
fast machine they return at once, on a slow one they wait longer, and only a state that
never comes fails the test, with an ``AssertionError`` naming what was awaited.

``holds_for`` / ``holds_for_async`` check an invariant over an interval: something that
must stay true however long one waits ("a paused engine produces no token"). Their
duration never decides the outcome on a correct system: a shorter interval only checks
less.

``tests/test_layout.py`` flags any other ``sleep(<non-zero literal>)`` in ``tests/``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["holds_for", "holds_for_async", "wait_until", "wait_until_async"]

T = TypeVar("T")

CHECK_S = 0.005  # how often a predicate is checked again (latency, not a guess)


def wait_until(
    predicate: Callable[[], T], timeout_s: float, what: str, check_s: float = CHECK_S
) -> T:
    """Return ``predicate()``'s first truthy value; raise ``AssertionError`` naming
    ``what`` if none comes within ``timeout_s`` (a deadline, not an expected duration).
    ``check_s`` paces the checks (raise it for a costly predicate, e.g. an HTTP call)."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(check_s)
    return value


async def wait_until_async(
    predicate: Callable[[], T], timeout_s: float, what: str, check_s: float = CHECK_S
) -> T:
    """``wait_until`` for a coroutine: the event loop keeps running between checks."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(check_s)
    return value


def holds_for(predicate: Callable[[], object], duration_s: float, what: str) -> None:
    """Check that ``predicate()`` stays true for ``duration_s``; raise ``AssertionError``
    naming ``what`` the first time it is false. For invariants only: a correct system
    passes whatever ``duration_s`` and however fast the machine."""
    end = time.monotonic() + duration_s
    while True:
        assert predicate(), f"no longer true: {what}"
        if time.monotonic() > end:
            return
        time.sleep(CHECK_S)


async def holds_for_async(predicate: Callable[[], object], duration_s: float, what: str) -> None:
    """``holds_for`` for a coroutine: the event loop keeps running between checks."""
    end = time.monotonic() + duration_s
    while True:
        assert predicate(), f"no longer true: {what}"
        if time.monotonic() > end:
            return
        await asyncio.sleep(CHECK_S)
