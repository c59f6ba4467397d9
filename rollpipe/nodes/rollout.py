"""Rollout: many episodes at once, every live request in flight together.

Each episode is a coroutine (``rollpipe.agent.episode.run_episode``). Up to ``concurrency``
run on one event loop, so all of their engine requests reach the engine together and
its continuous batching does the batching: no lockstep turns, and a long episode never
holds back the others. The loop is the engine's own (``engine.loop_thread``) by default:
between two engine steps, the episodes whose turn just ended build and submit their
next request, which joins the very next step; no thread hop, no GIL hand-offs. Env
calls run inline on that loop, or on a thread pool with ``env_workers > 0``.

Collection continues in the background between ``next()`` calls — while the trainer
computes — up to ``max_buffered`` finished trajectories; ``suspend()`` (the admission
gate) stops it. With ``in_order=True`` (as in torchdata's ``ParallelMapper``)
trajectories come out in admission order, which makes runs and checkpoint restores
reproducible; ``in_order=False`` yields them as they finish. A checkpoint records the
specs admitted but not yet yielded; a restore re-runs them, and their derived seeds
reproduce them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections import deque
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, TypeVar

from torchdata.nodes import BaseNode

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import run_episode
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.engines.base import Engine, EngineClosedError, SamplingParams
from rollpipe.envs import make as make_env
from rollpipe.nodes.signals import RolloutControl
from rollpipe.runtime import Runtime

T = TypeVar("T")
EnvFactory = Callable[[EpisodeSpec], Any]
"""Builds an environment for a spec; the default uses ``rollpipe.envs.make``."""

_END = object()  # the stream is over (a coroutine cannot raise StopIteration)
_TICK_S = 0.02  # how often the driver looks at the gate, cancellations and capacity


def registry_env_factory(spec: EpisodeSpec) -> Any:
    """The env named by the spec, from the registry, with the spec's config."""
    return make_env(spec.env, **dict(spec.env_config))


class Rollout(BaseNode[Trajectory]):
    """Runs episode specs from ``source`` to finished :class:`Trajectory` records.

    Args:
        source: node yielding :class:`EpisodeSpec` (usually an ``EpisodeSource``).
        engine: the generation engine (``VLLMEngine``, ``HFEngine``, ...).
        chat: a :class:`ChatFormat`, or a tokenizer to build the default one from.
        sampling: sampling parameters; per-turn seeds derive from the episode seed.
        max_turns: turns before an episode ends with ``max_turns``.
        max_length: token budget of a whole trajectory (prompts plus responses).
        concurrency: episodes in flight at once.
        env_factory: builds an env for a spec (default: the registry). Instances are
            pooled and reused; ``env_ids`` in the rows name the instance.
        env_workers: threads for a ``TextEnv``'s calls; 0 runs them inline on the loop.
        in_order: yield in admission order (reproducible) or completion order.
        max_buffered: finished trajectories held, not yet yielded, before admission
            pauses (default ``4 * concurrency``).
        control: shared :class:`RolloutControl` (admission gate, cancelled groups).
        engine_loop: run the episodes on the engine's own event-loop thread when it has
            one (``engine.loop_thread``: every ``BaseEngine``), so a finished turn's next
            request reaches the engine before its next step, with no thread hop and no
            GIL hand-offs between two busy threads; ``False`` (or an engine without
            one) gives the rollout a thread of its own.
        episode_kwargs: passed to ``run_episode`` (``raise_env_errors``, ``on_length``...).
    """

    def __init__(
        self,
        source: BaseNode[EpisodeSpec],
        engine: Engine,
        chat: Any,
        *,
        sampling: SamplingParams | None = None,
        max_turns: int = 5,
        max_length: int = 1024,
        concurrency: int = 32,
        env_factory: EnvFactory | None = None,
        env_workers: int = 0,
        in_order: bool = True,
        max_buffered: int | None = None,
        control: RolloutControl | None = None,
        engine_loop: bool = True,
        **episode_kwargs: Any,
    ) -> None:
        super().__init__()
        for name, value in (
            ("max_turns", max_turns),
            ("max_length", max_length),
            ("concurrency", concurrency),
        ):
            if value < 1:
                raise ValueError(f"Rollout: {name} must be >= 1, got {value}")
        if env_workers < 0:
            raise ValueError(
                f"Rollout: env_workers must be >= 0 (0: env calls inline), got {env_workers}"
            )
        self.source = source
        self.engine = engine
        self.chat = chat if isinstance(chat, ChatFormat) else ChatFormat(chat)
        self.sampling = sampling or SamplingParams()
        self.max_turns = max_turns
        self.max_length = max_length
        self.concurrency = concurrency
        self.env_factory = env_factory or registry_env_factory
        self.env_workers = env_workers
        self.in_order = in_order
        self.max_buffered = max_buffered or 4 * concurrency
        self.control = control or RolloutControl()
        self.engine_loop = engine_loop
        self.episode_kwargs = episode_kwargs
        self._runner: Runtime | None = None
        self._owns_runner = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._driver: asyncio.Task[None] | None = None
        self._free_envs: dict[Hashable, list[tuple[int, Any]]] = {}
        self._all_envs: list[Any] = []
        self._closed = False
        self._clear()

    # -- running on the node's loop thread --------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and wait for its result (or exception)."""
        if self._closed:
            coro.close()
            raise RuntimeError("Rollout is closed; build a new one")
        if self._runner is None:
            shared = self.engine.runtime if self.engine_loop else None
            self._owns_runner = shared is None
            self._runner = shared or Runtime("rollpipe-rollout")
            if self.env_workers > 0:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.env_workers, thread_name_prefix="rollpipe-env"
                )
        if self._runner.in_loop():
            coro.close()
            raise RuntimeError(
                "Rollout blocks for its results; call it from another thread than the "
                "event loop its episodes run on"
            )
        if not self._runner_alive():
            coro.close()
            raise self._engine_gone()
        future = asyncio.run_coroutine_threadsafe(coro, self._runner.loop)
        while True:  # in slices: a shared engine loop may stop under the call
            try:
                return future.result(timeout=None if self._owns_runner else 0.5)
            except concurrent.futures.TimeoutError:
                if not self._runner_alive():
                    future.cancel()
                    raise self._engine_gone() from None
            except concurrent.futures.CancelledError:
                if self._owns_runner:
                    raise
                raise self._engine_gone() from None

    def _runner_alive(self) -> bool:
        runner = self._runner
        return runner is not None and runner.thread.is_alive() and not runner.loop.is_closed()

    def _engine_gone(self) -> EngineClosedError:
        return EngineClosedError(
            f"{type(self.engine).__name__} was closed, and its event loop ran this rollout's "
            "episodes; build a new engine and pipeline"
        )

    # -- bookkeeping (loop thread only) -----------------------------------------------
    def _clear(self) -> None:
        self._live: dict[int, asyncio.Task[Trajectory]] = {}
        self._pending: dict[int, EpisodeSpec] = {}  # admitted, not yet yielded
        self._results: dict[int, Trajectory | None] = {}  # finished (None: cancelled)
        self._finish_order: deque[int] = deque()
        self._requeue: deque[EpisodeSpec] = deque()  # restored specs to run first
        self._next_index = 0
        self._emit_index = 0
        self._source_done = False
        self._requests_at_stop = 0  # replacement requests already pending when it stopped
        self._source_state: dict[str, Any] | None = None
        self._failure: BaseException | None = None
        self._done: deque[tuple[int, asyncio.Task[Trajectory]]] = deque()  # finished tasks
        self._changed = asyncio.Event()  # an episode finished, or a tick passed
        self._wake: asyncio.Event | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._call(self._restart(initial_state))

    async def _restart(self, initial_state: dict[str, Any] | None) -> None:
        await self._stop_all()
        self._clear()
        if initial_state is None:
            self.source.reset(None)
        else:
            self.source.reset(initial_state["source"])
            self._requeue.extend(initial_state["pending"])
        self._source_state = self.source.state_dict()
        self._wake = asyncio.Event()
        self._driver = asyncio.get_running_loop().create_task(self._drive())

    def get_state(self) -> dict[str, Any]:
        return self._call(self._snapshot())

    async def _snapshot(self) -> dict[str, Any]:
        return {
            "source": self._source_state,
            "pending": list(self._pending.values()) + list(self._requeue),
        }

    # -- environments -----------------------------------------------------------------
    def _acquire_env(self, spec: EpisodeSpec) -> tuple[int, Any]:
        free = self._free_envs.setdefault((spec.env, spec.env_config), [])
        if free:
            return free.pop()
        env = self.env_factory(spec)
        self._all_envs.append(env)
        return len(self._all_envs) - 1, env

    def _release_env(self, spec: EpisodeSpec, env_id: int, env: Any) -> None:
        self._free_envs[(spec.env, spec.env_config)].append((env_id, env))

    async def _run(self, spec: EpisodeSpec) -> Trajectory:
        env_id, env = self._acquire_env(spec)
        try:
            return await run_episode(
                spec,
                env,
                self.engine,
                self.chat,
                sampling=self.sampling,
                max_turns=self.max_turns,
                max_length=self.max_length,
                env_id=env_id,
                admit=self.control.admit,
                env_executor=self._executor,
                **self.episode_kwargs,
            )
        finally:
            self._release_env(spec, env_id, env)

    # -- the driver: admission and completion, in the background ----------------------
    async def _drive(self) -> None:
        """Admit while there is room, collect finished episodes, wake ``next()``.

        Event driven: an episode's completion wakes it at once; a tick wakes it to look at
        what other threads change (the gate, cancellations, replacement requests).
        """
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._cancel_unwanted()
                self._admit()
                if not self._done:
                    tick = loop.call_later(_TICK_S, self._changed.set)
                    await self._changed.wait()
                    tick.cancel()
                self._changed.clear()
                if self._collect() or self._is_over():
                    self._wake.set()
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # an engine death or a re-raised env error
            self._failure = error
            self._wake.set()

    def _take_spec(self) -> EpisodeSpec | None:
        if self._requeue:
            return self._requeue.popleft()
        if self._source_done and not self._new_requests():
            return None
        try:
            spec = next(self.source)
        except StopIteration:
            self._source_done = True
            self._requests_at_stop = self.control.replacements_pending
            return None
        self._source_done = False
        self._source_state = self.source.state_dict()
        return spec

    def _admit(self) -> None:
        loop = asyncio.get_running_loop()
        while (
            len(self._live) < self.concurrency
            and len(self._results) < self.max_buffered
            and self.control.is_open
        ):
            spec = self._take_spec()
            if spec is None:
                return
            index = self._next_index
            self._next_index += 1
            self._pending[index] = spec
            if self.control.is_cancelled(spec.group_id):
                self._finish(index, None)
            else:
                task = loop.create_task(self._run(spec))
                task.add_done_callback(functools.partial(self._on_done, index))
                self._live[index] = task

    def _cancel_unwanted(self) -> None:
        cancelled = self.control.cancelled_groups()
        if not cancelled:
            return
        for index, task in self._live.items():
            if self._pending[index].group_id in cancelled:
                task.cancel()

    def _finish(self, index: int, result: Trajectory | None) -> None:
        self._results[index] = result
        self._finish_order.append(index)

    def _on_done(self, index: int, task: asyncio.Task[Trajectory]) -> None:
        """Done callback of an episode task: queue it for the driver and wake it."""
        if not task.cancelled():
            task.exception()  # retrieved: the driver re-raises it, unless the loop stops first
        self._done.append((index, task))
        self._changed.set()

    def _collect(self) -> bool:
        """Move finished episodes to the results; True if any finished."""
        collected = False
        while self._done:
            index, task = self._done.popleft()
            if self._live.get(index) is not task:  # stopped by a reset or close
                continue
            del self._live[index]
            collected = True
            if task.cancelled():
                self._finish(index, None)
                continue
            error = task.exception()
            if error is not None:
                raise error
            self._finish(index, task.result())
        return collected

    def _new_requests(self) -> bool:
        """Replacement groups were requested since the source last ran dry."""
        return self.control.replacements_pending > self._requests_at_stop

    def _is_over(self) -> bool:
        return (
            not self._live
            and not self._results
            and not self._requeue
            and self._source_done
            and not self._new_requests()
        )

    # -- yielding ---------------------------------------------------------------------
    def _pop_ready(self) -> Trajectory | None:
        while True:
            if self.in_order:
                index = self._emit_index
                if index not in self._results:
                    return None
                self._emit_index += 1
            else:
                if not self._finish_order:
                    return None
                index = self._finish_order.popleft()
            result = self._results.pop(index)
            del self._pending[index]
            if result is not None and not self.control.is_cancelled(result.group_id):
                return result

    async def _next_ready(self) -> Any:
        assert self._wake is not None
        while True:
            if self._failure is not None:
                raise self._failure
            item = self._pop_ready()
            if item is not None:
                self._changed.set()  # room in the buffer: the driver may admit more
                return item
            if self._is_over():
                return _END
            self._wake.clear()
            await self._wake.wait()

    def next(self) -> Trajectory:
        item = self._call(self._next_ready())
        if item is _END:
            raise StopIteration
        return item  # type: ignore[no-any-return]

    @property
    def num_buffered(self) -> int:
        """Finished trajectories waiting to be yielded (a monitoring snapshot)."""
        return len(self._results)

    # -- lifecycle --------------------------------------------------------------------
    async def _stop_all(self) -> None:
        tasks = [t for t in (self._driver, *self._live.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._driver = None
        self._live.clear()

    def close(self) -> None:
        """Cancel live episodes, stop the threads, close the envs. Idempotent."""
        if self._closed:
            return
        if self._runner is not None:
            if self._runner_alive():  # (a closed engine's loop is not)
                self._call(self._stop_all())
            if self._owns_runner:
                self._runner.close()
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        for env in self._all_envs:
            close = getattr(env, "close", None)
            if close is not None:
                close()
        self._all_envs.clear()
        self._free_envs.clear()
