"""EnvThreads: blocking env calls off the loop, each with a time limit; a hung call's
worker is abandoned and replaced, and its thread ends once the call returns."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.agent.env_threads import EnvLease, EnvThreads, EnvTimeoutError


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "test-env"]


def test_a_call_runs_off_the_loop_and_returns() -> None:
    threads = EnvThreads(2, "test-env")

    async def main() -> tuple[int, bool]:
        loop_thread = threading.current_thread()
        return await threads.call(lambda x: (x + 1, threading.current_thread() is loop_thread), 1)

    assert asyncio.run(main()) == (2, False)
    assert threads.close(30)  # a deadline: idle workers end at once
    assert workers() == []


def test_a_hung_call_times_out_and_its_place_is_refilled() -> None:
    threads = EnvThreads(1, "test-env")
    release = threading.Event()
    returned: list[str] = []

    async def main() -> tuple[float, int]:
        start = time.monotonic()
        with pytest.raises(EnvTimeoutError, match=r"no return within 0\.2 s"):
            await threads.call(
                release.wait, 30, timeout=0.2, on_return=lambda: returned.append("hung")
            )
        took = time.monotonic() - start
        # the only worker is stuck, yet the next call runs at once on a fresh one
        value = await threads.call(lambda: 7, timeout=10)  # behind the hang it would fail
        return took, value

    took, value = asyncio.run(main())
    assert took >= 0.2 and value == 7  # the limit was kept, and the call ended before...
    assert threads.timeouts == 1 and returned == []  # ...the hung call returned
    assert len(workers()) == 2  # the abandoned one, and its replacement
    assert threads.close(30) is True  # the replacement ends; the abandoned is not waited
    release.set()
    for t in workers():
        t.join(5)
    assert workers() == []


def test_time_queued_does_not_count_against_the_limit() -> None:
    threads = EnvThreads(1, "test-env")

    async def main() -> list[object]:
        slow = threads.call(time.sleep, 3.0, timeout=30)  # 3 s of work; 30 s: a deadline
        queued = threads.call(lambda: "ok", timeout=1.0)  # waits 3 s in the queue
        return list(await asyncio.gather(slow, queued))

    assert asyncio.run(main()) == [None, "ok"]
    threads.close(1.0)


def test_a_lease_gives_the_env_back_only_once_its_call_returned() -> None:
    threads = EnvThreads(1, "test-env")
    release = threading.Event()
    given_back: list[float] = []

    async def main() -> None:
        back = asyncio.Event()
        lease = EnvLease(lambda: (given_back.append(time.monotonic()), back.set()))
        lease.call_started()
        entered = threading.Event()

        def env_call() -> None:
            entered.set()
            release.wait(30)

        task = asyncio.ensure_future(threads.call(env_call, on_return=lease.call_returned))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()  # the episode is cancelled while the call runs
        lease.end()
        assert given_back == []  # not reusable yet: a thread is still inside it
        release.set()
        await asyncio.wait_for(back.wait(), 5)  # given back once the call returned

    asyncio.run(main())
    assert len(given_back) == 1
    threads.close(1.0)


@settings(max_examples=25, deadline=None)
@given(calls=st.lists(st.sampled_from([0.0, 0.001, "hang"]), min_size=1, max_size=6))
def test_every_call_either_returns_or_times_out(calls: list[float | str]) -> None:
    """Quick calls return (their limit is a deadline) even behind hung ones; a call that
    hangs (it waits until the test ends) times out after its 0.1 s limit."""
    threads = EnvThreads(2, "test-env")
    release = threading.Event()

    async def main() -> list[object]:
        waits = [
            threads.call(release.wait, 30, timeout=0.1)
            if c == "hang"
            else threads.call(time.sleep, c, timeout=30)
            for c in calls
        ]
        return list(await asyncio.gather(*waits, return_exceptions=True))

    results = asyncio.run(main())
    release.set()
    for c, r in zip(calls, results, strict=True):
        assert isinstance(r, EnvTimeoutError) if c == "hang" else r is None
    threads.close(1.0)
    for t in workers():
        t.join(2)
    assert workers() == []
