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
    assert threads.close(1.0)
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
        value = await threads.call(lambda: 7, timeout=1.0)
        return took, value

    took, value = asyncio.run(main())
    assert 0.2 <= took < 2.0 and value == 7
    assert threads.timeouts == 1 and returned == []  # the hung call has not returned
    assert len(workers()) == 2  # the abandoned one, and its replacement
    assert threads.close(1.0) is True  # the replacement ends; the abandoned is not waited
    release.set()
    for t in workers():
        t.join(5)
    assert workers() == []


def test_time_queued_does_not_count_against_the_limit() -> None:
    threads = EnvThreads(1, "test-env")

    async def main() -> list[object]:
        slow = threads.call(time.sleep, 0.3, timeout=1.0)
        queued = threads.call(lambda: "ok", timeout=0.1)  # waits 0.3 s in the queue
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
        task = asyncio.ensure_future(threads.call(release.wait, 5, on_return=lease.call_returned))
        await asyncio.sleep(0.05)
        task.cancel()  # the episode is cancelled while the call runs
        lease.end()
        assert given_back == []  # not reusable yet: a thread is still inside it
        release.set()
        await asyncio.wait_for(back.wait(), 5)  # given back once the call returned

    asyncio.run(main())
    assert len(given_back) == 1
    threads.close(1.0)


@settings(max_examples=25, deadline=None)
@given(durations=st.lists(st.sampled_from([0.0, 0.001, 0.3]), min_size=1, max_size=6))
def test_every_call_either_returns_or_times_out(durations: list[float]) -> None:
    threads = EnvThreads(2, "test-env")

    async def main() -> list[object]:
        calls = [threads.call(time.sleep, d, timeout=0.1) for d in durations]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    results = asyncio.run(main())
    for d, r in zip(durations, results, strict=True):
        assert (r is None) if d < 0.1 else isinstance(r, EnvTimeoutError)
    threads.close(1.0)
    for t in workers():
        t.join(2)
    assert workers() == []
