"""Feed: a thread's items handed to a coroutine in order, ended by ``last``, an error or
``stop()``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.runtime import Feed


@pytest.fixture
def thread() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool


async def drain(feed: Feed[int]) -> list[int]:
    out = []
    while (item := await feed.next()) is not None:
        out.append(item)
    assert await feed.next() is None  # over stays over
    return out


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 50), stop_at=st.none() | st.integers(0, 60))
def test_items_come_in_order_and_last_ends_the_feed(n, stop_at) -> None:
    made = iter(range(100))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        feed = Feed(pool, lambda: next(made), n, last=lambda i: i == stop_at)
        got = asyncio.run(drain(feed))
    expected = list(range(n))
    if stop_at is not None and stop_at < n:
        expected = expected[: stop_at + 1]
    assert got == expected


def test_an_error_is_raised_in_its_place(thread) -> None:
    calls = [1, 2]

    def make() -> int:
        if not calls:
            raise ValueError("the source failed")
        return calls.pop(0)

    async def main() -> list[int]:
        feed = Feed(thread, make, 5)
        got = [await feed.next(), await feed.next()]
        with pytest.raises(ValueError, match="the source failed"):
            await feed.next()
        assert await feed.next() is None
        return got  # type: ignore[return-value]

    assert asyncio.run(main()) == [1, 2]


def test_stop_makes_no_more_items(thread) -> None:
    """A feed stopped while an item is being made makes no further item."""
    started, release = threading.Event(), threading.Event()
    calls = []

    def make() -> int:
        calls.append(1)
        started.set()
        release.wait(30)
        return len(calls)

    feed = Feed(thread, make, 10)
    assert started.wait(30)
    feed.stop()
    release.set()
    thread.shutdown(wait=True)  # the job has ended
    assert calls == [1]


def test_a_feed_stopped_before_its_thread_is_free_never_runs(thread) -> None:
    busy, release = threading.Event(), threading.Event()
    thread.submit(lambda: (busy.set(), release.wait(30)))
    assert busy.wait(30)
    ran = []
    feed = Feed(thread, lambda: ran.append(1) or 1, 3)
    feed.stop()
    release.set()
    thread.shutdown(wait=True)
    assert ran == []
