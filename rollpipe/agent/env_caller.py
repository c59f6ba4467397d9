"""EnvCaller: how one episode calls its env (awaited, inline, or on env threads), each
call limited in time and its return checked; a failure of any kind becomes ``EnvFailed``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rollpipe.agent.eager import started
from rollpipe.agent.env_contract import is_blocking
from rollpipe.agent.env_errors import EnvFailed
from rollpipe.agent.env_threads import EnvLease, EnvThreads, EnvTimeoutError
from rollpipe.agent.records import EpisodeSpec

if TYPE_CHECKING:
    from rollpipe.agent.actions import AssistantAction
    from rollpipe.agent.env_contract import RunsTools

__all__ = ["SLOW_INLINE_S", "Clock", "EnvCaller"]

T = TypeVar("T")
_log = logging.getLogger(__name__)

SLOW_INLINE_S = 0.05
"""An inline (``blocking = False``) env call longer than this is reported, once per class:
the grid envs take microseconds, and every episode waits while one runs."""
_SLOW_INLINE_REPORTED: set[type] = set()


class Clock:
    """Where one episode's time went, and what it counted."""

    def __init__(self) -> None:
        self.env = 0.0
        self.engine = 0.0
        self.aborted_tokens = 0  # generated, then aborted by a pause and regenerated
        self.clipped_rewards = 0  # step rewards clipped to ±reward_clip


class EnvCaller:
    """How one episode calls its env: awaited (async env), inline (declared
    ``blocking = False``) or on ``threads`` (any other), each call limited to ``timeout``
    seconds and its return ``check``ed. Any failure becomes ``EnvFailed``."""

    def __init__(
        self,
        env: Any,
        spec: EpisodeSpec,
        threads: EnvThreads | None,
        timeout: float | None,
        lease: EnvLease | None,
        force_threads: bool,
        clock: Clock,
    ) -> None:
        self.env, self.spec, self.threads, self.timeout = env, spec, threads, timeout
        self.lease, self.clock = lease, clock
        self.inline = not force_threads and not is_blocking(env)
        # each env method (by id, held so the id is not reused): a coroutine function?
        self._awaitable: dict[int, tuple[Any, bool]] = {}

    def episode(self, turn: int) -> str:
        spec = self.spec
        return f"env {spec.env_name!r}, seed {spec.seed}, episode {spec.episode_id}, turn {turn}"

    def where(self, name: str, turn: int) -> str:
        limit = f", env_timeout_s={self.timeout}" if self.timeout is not None else ""
        return f"{type(self.env).__name__}.{name}: {self.episode(turn)}{limit}"

    async def __call__(
        self, name: str, turn: int, check: Callable[[Any], T], arg: Any, **kwargs: Any
    ) -> T:
        fn = getattr(self.env, name)
        func = getattr(fn, "__func__", fn)  # a method's function: the same every turn
        known = self._awaitable.get(id(func))
        if known is None or known[0] is not func:
            known = self._awaitable[id(func)] = (func, inspect.iscoroutinefunction(fn))
        awaitable = known[1]
        if kwargs:  # reset(seed, row=...) of a dataset's group
            fn = functools.partial(fn, **kwargs)
        start = time.perf_counter()
        try:
            if awaitable:  # run at once up to its first wait: the usual step waits on nothing
                done, result = started(fn(arg))
                if not done:
                    result = await self._timed(result)
            elif self.inline:  # declared fast: cheaper than a thread hop
                result = fn(arg)
                self._check_inline_time(time.perf_counter() - start)
            else:
                if self.lease is not None:
                    self.lease.call_started()
                on_return = None if self.lease is None else self.lease.call_returned
                assert self.threads is not None, "a blocking env's episode has threads"
                result = await self.threads.call(fn, arg, timeout=self.timeout, on_return=on_return)
            if type(result) is not tuple and inspect.isawaitable(result):  # tuple: the usual
                result = await self._awaited(result)
            return check(result)
        except Exception as exc:  # the env's failure, whatever it is
            raise EnvFailed(exc, self.where(name, turn)) from exc
        finally:
            self.clock.env += time.perf_counter() - start

    async def run_tools(
        self, runner: RunsTools, action: AssistantAction, turn: int
    ) -> AssistantAction:
        """``action`` with the results of its tool calls, run by the env's ``runner``;
        timed and limited like an env call (``env_timeout_s``), a failure ``EnvFailed``.
        Calls that all run inline (the runner's ``run_inline`` answers) run at once: a
        timer could not stop them on the loop, and it costs ~8 µs a turn."""
        start = time.perf_counter()
        try:
            now = getattr(runner, "run_inline", None)  # no call waits: no await, no timer
            results = None if now is None else now(action)
            if results is None:
                results = await self._awaited(runner.run(action))
        except Exception as exc:  # the runner's own failure (a tool's is a message)
            raise EnvFailed(exc, self.where("tool_runner.run", turn)) from exc
        finally:
            self.clock.env += time.perf_counter() - start
        return action.with_results(results)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the episode's env threads, the loop serving every other
        episode meanwhile (a big prompt's render and tokenization); inline when the
        episode has no threads (an env declared ``blocking = False`` run alone). No time
        limit: it is rollpipe's own work, and a thread abandoned mid-render would leave
        the conversation half changed."""
        if self.threads is None:
            return fn(*args)
        result: T = await self.threads.call(fn, *args)
        return result

    async def _awaited(self, awaitable: Any) -> Any:
        """``awaitable``'s result within ``timeout`` (from now); a coroutine that returns
        without waiting (``rollpipe.agent.eager``) needs no timer."""
        done, rest = started(awaitable)
        return rest if done else await self._timed(rest)

    async def _timed(self, awaitable: Any) -> Any:
        """``awaitable``'s result within ``timeout`` from now (a coroutine's rest from
        where it first waits: what ran before could not be timed on the loop anyway)."""
        if self.timeout is None:
            return await awaitable
        try:
            async with asyncio.timeout(self.timeout):  # no task of its own, as wait_for's
                return await awaitable
        except TimeoutError:
            raise EnvTimeoutError(f"no return within {self.timeout} s") from None

    def _check_inline_time(self, elapsed: float) -> None:
        cls = type(self.env)
        if self.timeout is not None and elapsed > self.timeout:
            raise EnvTimeoutError(
                f"took {elapsed:.2f} s inline on the event loop (over {self.timeout} s), "
                f"stalling every episode: {cls.__qualname__} declares blocking = False; "
                "remove that declaration so its calls run on env threads"
            )
        if elapsed > SLOW_INLINE_S and cls not in _SLOW_INLINE_REPORTED:
            _SLOW_INLINE_REPORTED.add(cls)
            _log.warning(
                "%s.%s declares blocking = False but one call took %.3f s inline on the "
                "event loop, stalling every episode and the engine meanwhile; remove that "
                "declaration so its calls run on env threads (reported once per class)",
                cls.__module__,
                cls.__qualname__,
                elapsed,
            )
