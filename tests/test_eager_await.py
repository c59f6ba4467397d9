"""Eager awaits (``rollpipe.agent.eager``): a coroutine run up to its first wait, then
awaited from there, gives what awaiting it gives — its result, its exception, after any
number of waits — and a cancellation reaches the coroutine where it waits. An env call
that waits past ``env_timeout_s`` still fails with ``EnvTimeoutError``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.agent.eager import started
from rollpipe.agent.env_caller import Clock, EnvCaller
from rollpipe.agent.env_errors import EnvFailed
from rollpipe.agent.env_threads import EnvTimeoutError
from rollpipe.agent.records import EpisodeSpec


async def body(waits: int, fail_at: int | None, log: list[str]) -> int:
    """Waits ``waits`` times (noting each), raising at wait ``fail_at`` if given."""
    for i in range(waits + 1):
        if i == fail_at:
            raise ValueError(f"failed at {i}")
        if i < waits:
            await asyncio.sleep(0)
            log.append(f"woke {i}")
    return waits * 10


async def outcome(awaitable: Any) -> tuple[str, Any]:
    try:
        return "result", await awaitable
    except ValueError as exc:
        return "error", str(exc)


@settings(max_examples=60, deadline=None)
@given(waits=st.integers(0, 4), fail_at=st.one_of(st.none(), st.integers(0, 4)))
def test_an_eager_start_gives_what_awaiting_gives(waits: int, fail_at: int | None) -> None:
    plain_log: list[str] = []
    plain = asyncio.run(outcome(body(waits, fail_at, plain_log)))
    eager_log: list[str] = []

    async def eagerly() -> tuple[str, Any]:
        try:
            done, rest = started(body(waits, fail_at, eager_log))
        except ValueError as exc:  # raised before its first wait
            return "error", str(exc)
        return ("result", rest) if done else await outcome(rest)

    assert asyncio.run(eagerly()) == plain and eager_log == plain_log
    done_at_once = waits == 0 or fail_at == 0
    if done_at_once:
        assert plain_log == []


def test_a_cancellation_reaches_the_coroutine_where_it_waits() -> None:
    seen: list[str] = []

    async def waiting(event: asyncio.Event) -> None:
        try:
            await event.wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main() -> None:
        event = asyncio.Event()
        done, rest = started(waiting(event))
        assert not done
        task = asyncio.ensure_future(_awaiting(rest))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["cancelled"]


async def _awaiting(rest: Any) -> Any:
    return await rest


class Waits:
    """An async env whose step waits on an event no one sets, or returns at once."""

    def __init__(self) -> None:
        self.never = asyncio.Event()

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if action == "wait":
            await self.never.wait()
        return "ok", 0.0, False, False, {}


@pytest.mark.parametrize("action", ["now", "wait"])
def test_an_env_call_is_timed_only_when_it_waits(action: str) -> None:
    env = Waits()
    caller = EnvCaller(env, EpisodeSpec(0, 0, 1), None, 0.05, None, False, Clock())

    async def main() -> Any:
        return await caller("step", 0, lambda result: result, action)

    if action == "now":
        assert asyncio.run(main())[0] == "ok"
    else:
        with pytest.raises(EnvFailed) as failed:
            asyncio.run(main())
        assert isinstance(failed.value.error, EnvTimeoutError)


class FailsAtOnce:
    """An async env whose step raises before it waits on anything."""

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        raise KeyError(action)


@pytest.mark.parametrize("timeout", [None, 0.05])
def test_an_env_call_that_fails_before_waiting_is_the_episode_s_failure(
    timeout: float | None,
) -> None:
    """The step runs at once (no timer armed) with or without ``env_timeout_s``; what it
    raises there is the episode's ``EnvFailed`` naming the call, as for any env error."""
    caller = EnvCaller(FailsAtOnce(), EpisodeSpec(0, 0, 1), None, timeout, None, False, Clock())

    async def main() -> Any:
        return await caller("step", 3, lambda result: result, "left")

    with pytest.raises(EnvFailed) as failed:
        asyncio.run(main())
    assert isinstance(failed.value.error, KeyError)
    assert "FailsAtOnce.step" in str(failed.value) and "turn 3" in str(failed.value)
