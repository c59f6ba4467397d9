"""The one runtime: Runtime/Scope bridge calls, closes wake every waiter, Gate/Signal wake
without polling, from threads and loops alike."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from waiting import wait_until

from rollpipe.runtime import Gate, Runtime, RuntimeClosedError, Signal


@pytest.fixture
def runtime():
    rt = Runtime("test-runtime")
    yield rt
    rt.close()


def test_call_submit_and_run_from_another_loop(runtime):
    async def add(a, b):
        await asyncio.sleep(0)
        assert runtime.in_loop()
        return a + b

    assert runtime.call(add(2, 3)) == 5
    assert runtime.submit(add(1, 1)).result(5) == 2
    scope = runtime.scope("caller")
    assert asyncio.run(scope.run(add(4, 4))) == 8  # awaited on a foreign loop


def test_errors_cross_the_bridge_with_their_type(runtime):
    async def boom():
        raise KeyError("the key")

    with pytest.raises(KeyError, match="the key"):
        runtime.call(boom())


def test_a_coroutines_own_timeout_error_is_not_mistaken_for_the_wait(runtime):
    """An env's or a request's TimeoutError crosses the bridge as it is; only the wait's
    own limit reports "no result within"."""

    class EnvTimedOut(TimeoutError):
        pass

    async def times_out():
        raise EnvTimedOut("the env's own")

    async def slow():
        await asyncio.Event().wait()  # never set: no result, however long the wait

    scope = runtime.scope("caller")
    for timeout in (None, 5.0):
        with pytest.raises(EnvTimedOut, match="the env's own"):
            scope.call(times_out(), timeout)
    with pytest.raises(TimeoutError, match=r"caller: no result within 0\.05 s"):
        scope.call(slow(), 0.05)


def test_call_on_the_loop_itself_raises_instead_of_hanging(runtime):
    async def inner():
        return 1

    async def outer():
        coro = inner()
        with pytest.raises(RuntimeError, match="own thread"):
            runtime.call(coro)
        return "ok"

    assert runtime.call(outer()) == "ok"


def test_cancelling_the_future_cancels_the_task(runtime):
    started, cancelled = threading.Event(), threading.Event()

    async def forever():
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    future = runtime.submit(forever())
    assert started.wait(5)
    future.cancel()
    assert cancelled.wait(5)


def test_closing_a_scope_wakes_its_waiters_even_while_the_loop_is_blocked(runtime):
    scope = runtime.scope("part")
    release, blocked, unblocked = threading.Event(), threading.Event(), threading.Event()

    async def block_the_loop():
        blocked.set()
        release.wait(60)  # a blocking call on the loop, as an inline env step may be
        unblocked.set()

    async def never():
        await asyncio.Event().wait()

    waiting = scope.submit(never())
    runtime.submit(block_the_loop())
    assert blocked.wait(30)
    errors: list[BaseException] = []
    waiter = threading.Thread(target=lambda: errors.append(_raised(waiting.result)))
    waiter.start()
    scope.close(RuntimeClosedError("the part was closed"))
    waiter.join(30)  # a deadline: only a close that waits for the loop reaches it
    assert not waiter.is_alive() and not unblocked.is_set()  # woken while the loop is blocked
    assert isinstance(errors[0], RuntimeClosedError) and "part was closed" in str(errors[0])
    with pytest.raises(RuntimeClosedError, match="part was closed"):
        scope.submit(never())
    other = runtime.scope("other")  # other scopes are untouched
    release.set()
    assert other.call(_value(7)) == 7


def test_closing_the_runtime_fails_every_scope_and_stops_the_thread():
    rt = Runtime("closing")
    scopes = [rt.scope(f"s{i}") for i in range(3)]
    futures = [s.submit(asyncio.Event().wait()) for s in scopes]
    rt.close(RuntimeClosedError("engine gone"))
    for f in futures:
        with pytest.raises(RuntimeClosedError, match="engine gone"):
            f.result(2)
    assert not rt.thread.is_alive() and not rt.alive
    with pytest.raises(RuntimeClosedError, match="engine gone"):
        rt.scope("late").call(_value(1))
    rt.close()  # idempotent


def test_init_error_is_raised_in_the_caller():
    def bad_init():
        raise ValueError("no threads for you")

    with pytest.raises(ValueError, match="no threads"):
        Runtime("bad", init=bad_init)


def test_gate_wakes_coroutines_on_any_loop(runtime):
    gate = Gate(is_open=False)
    woke: list[str] = []

    async def waits(name):
        await gate.wait_async()
        woke.append(name)

    on_runtime = runtime.submit(waits("runtime"))
    other = threading.Thread(target=lambda: asyncio.run(waits("foreign loop")))
    other.start()
    # both are waiting (a closed gate wakes nobody, however long they wait)
    wait_until(lambda: len(gate._waiters) == 2, 30, "two waiters")
    assert woke == []
    threading.Thread(target=gate.open).start()  # opened from a third thread
    other.join(2)
    on_runtime.result(2)
    assert sorted(woke) == ["foreign loop", "runtime"]


def test_a_cancelled_wait_leaves_no_waiter(runtime):
    gate = Gate(is_open=False)

    async def cancel_a_wait():
        task = asyncio.ensure_future(gate.wait_async())
        while not gate._waiters:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return len(gate._waiters)

    assert runtime.call(cancel_a_wait()) == 0
    assert not gate.is_open


def test_signal_remembers_a_notify_made_before_the_wait(runtime):
    signal = Signal()
    signal.notify()
    runtime.call(asyncio.wait_for(signal.wait(), 1))  # returns at once
    waiting = runtime.submit(signal.wait())
    threading.Thread(target=signal.notify).start()
    waiting.result(2)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["open", "close"]), min_size=1, max_size=12))
def test_gate_state_follows_the_last_change(changes):
    gate = Gate(is_open=True)
    for change in changes:
        getattr(gate, change)()
    assert gate.is_open == (changes[-1] == "open")
    if gate.is_open:  # an open gate lets a waiter straight through
        asyncio.run(asyncio.wait_for(gate.wait_async(), 5))


async def _value(v):
    return v


def _raised(fn):
    try:
        fn()
    except BaseException as e:
        return e
    return None
