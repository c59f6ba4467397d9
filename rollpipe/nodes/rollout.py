"""EpisodeRunner: many episodes at once, every live request in flight together.

Each episode is a coroutine (``rollpipe.agent.episode.run_episode``). Up to ``concurrency`` run on
the engine's runtime (``engine.runtime``), so all of their engine requests reach the engine
together and its continuous batching does the batching: no lockstep turns, and a long episode never
holds back the others. Between two engine steps, the episodes whose turn just ended submit their
next request, which joins the very next step: no thread hop. Env calls that may block run on env
threads (``EnvThreads``), each limited to ``env_timeout_s``; envs declaring ``blocking = False``
run inline on the loop (unless ``env_workers > 0`` asks for threads for every env).

The upstream node is pulled on a thread of its own, never on the loop, so a slow or blocking node
before the rollout does not stall generation. Collection continues in the background between
``next()`` calls — while the trainer computes — up to ``max_buffered`` finished trajectories; the
admission gate (``PipelineSignals``) stops it. With ``in_order=True`` (as torchdata's
``ParallelMapper``) trajectories come out in admission order, so runs and checkpoint restores are
reproducible; ``in_order=False`` yields them as they finish. A checkpoint records the specs
admitted but not yet yielded (as plain data); a restore re-runs them from their derived seeds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

import attrs
from torchdata.nodes import BaseNode

from rollpipe._utils.checks import instance_of, int_in, one_of, optional
from rollpipe._utils.threads import shutdown_within
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.env_errors import FirstErrors
from rollpipe.agent.env_threads import EnvThreads
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.engines.protocol import Engine
from rollpipe.envs.pool import EnvForSpec, EnvPool, run_spec
from rollpipe.nodes.admitted import Admitted
from rollpipe.nodes.closing import close_chain
from rollpipe.nodes.signals import PipelineSignals
from rollpipe.runtime import Feed, Runtime, RuntimeClosedError, Signal
from rollpipe.workers.episode_workers import workers_for

_END = object()  # the stream is over (a coroutine cannot raise StopIteration)
CLOSE_WAIT_S = 0.5  # how long close() waits for episodes and threads to stop
MAX_CONCURRENCY = 65536
"""Episodes in flight (and env threads) at most: each holds a task, an env and buffers."""
MAX_EPISODE_WORKERS = 1024


@attrs.frozen(kw_only=True)
class RunnerSettings:
    """How many episodes run at once and where their envs run (``PipelineConfig.rollout``).

    ``concurrency``: episodes in flight at once (at most ``MAX_CONCURRENCY``).
    ``env_workers``: threads for env calls, used by every ``TextEnv``; 0: one per episode in
    flight, for envs that may block only (``blocking = False`` envs run inline).
    ``env_backend``: ``"local"`` (envs in this process) or ``"ray"`` (each env slot's env in a
    Ray actor, ``rollpipe.envs.ray_env``). ``in_order``: yield in admission order (reproducible)
    or completion order; None (auto): admission order here, resolved by
    ``PipelineConfig.admission_order`` in the standard chain. ``episode_workers``: N > 0 runs
    the episodes in N worker processes (``rollpipe.workers``), Ray actors with
    ``worker_options``; 0: on the engine's loop.

    Examples:
        >>> RunnerSettings(concurrency=8)  # doctest: +NORMALIZE_WHITESPACE
        RunnerSettings(concurrency=8, env_workers=0, env_backend='local', in_order=None,
                       episode_workers=0, worker_options={})
    """

    concurrency: int = attrs.field(default=32, validator=int_in(1, MAX_CONCURRENCY))
    env_workers: int = attrs.field(default=0, validator=int_in(0, MAX_CONCURRENCY))
    env_backend: Literal["local", "ray"] = attrs.field(
        default="local", validator=one_of("local", "ray")
    )
    in_order: bool | None = attrs.field(default=None, validator=optional(instance_of(bool)))
    episode_workers: int = attrs.field(default=0, validator=int_in(0, MAX_EPISODE_WORKERS))
    worker_options: Mapping[str, Any] = attrs.field(factory=dict, validator=instance_of(dict))


class EpisodeRunner(BaseNode[Trajectory]):
    """Runs episode specs from ``source`` to finished :class:`Trajectory` records.

    Args:
        source: node yielding :class:`EpisodeSpec` (usually an ``EpisodeSource``).
        engine: the generation engine (``VLLMEngine``, ``HFEngine``, ...).
        chat: a :class:`ChatFormat` (used as is), or a tokenizer to build one from
            ``episode``'s ``system_prompt`` and ``history_window``.
        settings: a :class:`RunnerSettings` (concurrency, env threads, order).
        episode: an :class:`EpisodeSettings`: how each episode runs.
        env_factory: builds an env for a spec (default: the registry). Instances are
            pooled and reused; ``env_ids`` in the rows name the instance.
        max_buffered: finished trajectories held, not yet yielded, before admission
            pauses (default ``4 * concurrency``).
        signals: shared :class:`PipelineSignals` (admission gate, cancelled groups).

    Examples:
        >>> from rollpipe import EpisodeSource
        >>> with contextlib.closing(EpisodeRunner(EpisodeSource(2, 2), engine, tokenizer)) as node:
        ...     [trajectory.traj_id for trajectory in node]  # in admission order
        ['frozenlake/g0/e0', 'frozenlake/g0/e1', 'frozenlake/g1/e2', 'frozenlake/g1/e3']
    """

    def __init__(
        self,
        source: BaseNode[EpisodeSpec],
        engine: Engine,
        chat: Any,
        settings: RunnerSettings | None = None,
        episode: EpisodeSettings | None = None,
        *,
        env_factory: EnvForSpec | None = None,
        max_buffered: int | None = None,
        signals: PipelineSignals | None = None,
    ) -> None:
        super().__init__()
        self.settings = RunnerSettings() if settings is None else settings
        self.episode = EpisodeSettings() if episode is None else episode
        self.concurrency = concurrency = self.settings.concurrency
        self.source = source
        self.engine = engine
        self.chat = chat if isinstance(chat, ChatFormat) else self.episode.chat_format(chat)
        self.in_order = self.settings.in_order is not False  # None (auto): admission order
        self.max_buffered = max_buffered or 4 * concurrency
        self.signals = signals or PipelineSignals()
        self._envs = EnvPool(env_factory)
        self._runtime: Runtime = engine.runtime
        self._scope = self._runtime.scope("EpisodeRunner")
        # One thread pulls the upstream node (never the loop); env threads run blocking envs.
        self._source_thread = concurrent.futures.ThreadPoolExecutor(1, "rollpipe-source")
        self._env_threads = EnvThreads(self.settings.env_workers or concurrency)
        args = (self.settings, engine, self.chat, self.episode, env_factory, self.signals.admit)
        if (workers := workers_for(*args)) is not None:  # episodes in worker processes
            self._scope.call(workers.start())
        self.workers = workers
        self._wakeup = Signal()  # the driver's: room to admit, the gate opened, a cancel...
        self.signals.add_listener(self._wakeup.notify)
        self._driver: asyncio.Task[None] | None = None
        self._closed = False
        self._first_errors = FirstErrors()  # a WARNING per env tag and error type, once
        self._clear()

    # -- bookkeeping (loop thread only) -----------------------------------------------
    def _clear(self) -> None:
        self._live: dict[int, asyncio.Task[Trajectory]] = {}
        self._book = Admitted(self.in_order)  # admitted, not yet yielded; their results
        self._requeue: deque[EpisodeSpec] = deque()  # restored specs to run first
        self._last_pulled: int | None = None  # group id of the last spec pulled
        self._source_done = False
        self._requests_at_stop = 0  # signals.requests_made when the source last ran dry
        self._source_state: dict[str, Any] | None = None
        self._failure: BaseException | None = None
        self._ready: asyncio.Event | None = None  # a result (or the end, or a failure)

    # -- torchdata protocol (caller's thread) -------------------------------------------
    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._scope.call(self._stop_all())
        source_state = None if initial_state is None else initial_state["source"]
        self._on_source_thread(self.source.reset, source_state)
        restored = [] if initial_state is None else initial_state["pending"]
        requeue = [EpisodeSpec.from_state(s) for s in restored]
        state = self._on_source_thread(self.source.state_dict)
        self._scope.call(self._start(requeue, state))

    def get_state(self) -> dict[str, Any]:
        return self._scope.call(self._snapshot())

    def next(self) -> Trajectory:
        item = self._scope.call(self._next_ready())
        if item is _END:
            raise StopIteration
        return item  # type: ignore[no-any-return]

    def _on_source_thread(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` on the source thread (after any pull in flight) and wait for it."""
        self._scope.check_open()
        return self._source_thread.submit(fn, *args).result()

    # -- on the loop -----------------------------------------------------------------------
    async def _start(self, requeue: list[EpisodeSpec], source_state: dict[str, Any]) -> None:
        self._clear()
        self._requeue.extend(requeue)
        self._source_state = source_state
        self._ready = asyncio.Event()
        self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _snapshot(self) -> dict[str, Any]:
        specs = [*self._book.pending.values(), *self._requeue]
        return {"source": self._source_state, "pending": [s.to_state() for s in specs]}

    async def _drive(self) -> None:
        """Admit while there is room; sleep until something changes (no polling)."""
        try:
            while True:
                self._cancel_unwanted()
                self._admit_waiting()
                if self._has_room() and self._may_pull():
                    await self._pull(self.concurrency - len(self._live))
                    continue
                if self._is_over():
                    self._notify_ready()
                await self._wakeup.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the source failed
            self._fail(error)

    def _has_room(self) -> bool:
        return (
            len(self._live) < self.concurrency
            and len(self._book.results) < self.max_buffered
            and self.signals.is_open
        )

    def _may_pull(self) -> bool:
        return not self._requeue and (not self._source_done or self._new_requests())

    def _admit_waiting(self) -> None:
        """Admit restored and pulled specs while there is room."""
        while self._requeue and self._has_room():
            self._admit(self._requeue.popleft())

    async def _pull(self, n: int) -> None:
        """Pull up to ``n`` specs on the source thread, admitting each as it comes: one job
        pulls them one after another (a ``Feed``), so a wave of specs arrives between two
        engine steps, not one per step and with no thread hop per spec; a pull that blocks
        holds back only the specs after it. The wave ends early when the source runs dry."""
        feed = Feed(self._source_thread, self._pull_one, n, last=lambda p: p[0] is None)
        try:
            while (pulled := await feed.next()) is not None:
                spec, state, requests_made = pulled
                if spec is None:
                    self._source_done = True
                    self._requests_at_stop = requests_made
                    continue
                self._source_done = False
                self._source_state, self._last_pulled = state, spec.group_id
                self._requeue.append(spec)
                self._admit_waiting()
        finally:
            feed.stop()  # a reset or close stopped the driver: no more pulls

    def _pull_one(self) -> tuple[EpisodeSpec | None, dict[str, Any] | None, int]:
        """Source thread: the next spec, the source's state after it, ``requests_made`` before."""
        requests_made = self.signals.requests_made
        try:
            spec = next(self.source)
        except StopIteration:
            return None, None, requests_made
        return spec, self.source.state_dict(), requests_made

    def _admit(self, spec: EpisodeSpec) -> None:
        index = self._book.admit(spec)
        if self.signals.is_cancelled(spec.group_id):
            self._finish(index, None)
            return
        task = asyncio.get_running_loop().create_task(self._run(spec))
        task.add_done_callback(functools.partial(self._on_done, index))
        self._live[index] = task

    async def _run(self, spec: EpisodeSpec) -> Trajectory:
        if self.workers is not None:  # the episode runs in a worker process
            return await self.workers.run(spec)
        return await run_spec(
            spec,
            self._envs,
            self.engine,
            self.chat,
            self.episode,
            admit=self.signals.admit,
            env_threads=self._env_threads,
            env_calls_on_threads=self.settings.env_workers > 0,
        )

    def _on_done(self, index: int, task: asyncio.Task[Trajectory]) -> None:
        """An episode ended: record its result (or failure) and wake both sides."""
        if self._live.get(index) is not task:  # stopped by a reset or close
            if not task.cancelled():
                task.exception()  # retrieved: nobody waits for it any more
            return
        del self._live[index]
        if task.cancelled():
            self._finish(index, None)
        elif (error := task.exception()) is not None:  # an engine death, a re-raised env error
            self._fail(error)
            return
        else:
            self._first_errors.saw(result := task.result())
            self._finish(index, result)
        self._wakeup.notify()

    def _cancel_unwanted(self) -> None:
        cancelled = self.signals.cancelled_groups()
        if not cancelled:
            return
        for index, task in self._live.items():
            if self._book.pending[index].group_id in cancelled:
                task.cancel()

    def _finish(self, index: int, result: Trajectory | None) -> None:
        self._book.finish(index, result)
        self._notify_ready()

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        self._notify_ready()

    def _notify_ready(self) -> None:
        if self._ready is not None:
            self._ready.set()

    def _new_requests(self) -> bool:
        """More groups were requested or granted since the source last ran dry."""
        return self.signals.requests_made > self._requests_at_stop

    def _is_over(self) -> bool:
        idle = not self._live and not self._book.results and not self._requeue
        return idle and self._source_done and not self._new_requests()

    def _pop_ready(self) -> Trajectory | None:
        """The next result to yield. Those of cancelled groups are skipped, except errors
        (counted downstream: every error is reported, even in a group already dropped)."""
        while (popped := self._book.pop()) is not None:
            spec, result = popped
            wanted = result is not None and (
                result.end_reason == "error" or not self.signals.is_cancelled(spec.group_id)
            )
            lowest = self._book.lowest_group(list(self._requeue), self._last_pulled)
            self.signals.settle_below(spec.group_id if lowest is None else lowest)
            if wanted:
                return result
        return None

    async def _next_ready(self) -> Any:
        assert self._ready is not None, "EpisodeRunner.next() before reset()"
        while True:
            if self._failure is not None:
                raise self._failure
            item = self._pop_ready()
            if item is not None:
                self._wakeup.notify()  # room in the buffer: the driver may admit more
                return item
            if self._is_over():
                return _END
            self._ready.clear()
            await self._ready.wait()

    @property
    def num_buffered(self) -> int:
        """Finished trajectories waiting to be yielded (a monitoring snapshot)."""
        return len(self._book.results)

    @property
    def num_in_flight(self) -> int:
        """Episodes admitted and still running (a monitoring snapshot)."""
        return len(self._live)

    # -- lifecycle --------------------------------------------------------------------
    async def _stop_all(self) -> None:
        tasks = [t for t in (self._driver, *self._live.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._driver = None
        self._live.clear()

    def close(self) -> None:
        """Stop the episodes and threads and close the envs; idempotent, prompt: a thread
        waiting in ``next()`` wakes at once with ``RuntimeClosedError``, the episodes are
        cancelled on the loop (waiting at most ``CLOSE_WAIT_S``: an env call blocking the loop
        is abandoned, not awaited), and the threads end once idle."""
        if self._closed:
            return
        self._closed = True
        self._scope.close(
            RuntimeClosedError("the EpisodeRunner was closed; build a new pipeline to go on")
        )
        self.signals.remove_listener(self._wakeup.notify)
        deadline = time.monotonic() + CLOSE_WAIT_S
        if self._runtime.alive:
            stopping = self._runtime.submit(self._stop_all())
            with contextlib.suppress(TimeoutError, RuntimeClosedError):
                stopping.result(CLOSE_WAIT_S)  # a loop blocked in an env call runs it later
            if self.workers is not None:  # stop the links, kill the actors
                with contextlib.suppress(TimeoutError, RuntimeClosedError):
                    self._runtime.submit(self.workers.close()).result(CLOSE_WAIT_S)
        shutdown_within(self._source_thread, max(0.0, deadline - time.monotonic()))
        self._env_threads.close(max(0.0, deadline - time.monotonic()))
        try:
            self._envs.close()
        finally:
            close_chain(self.source)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._scope.close()
            self._source_thread.shutdown(wait=False, cancel_futures=True)
            self._env_threads.close(0.0)


Rollout = EpisodeRunner  # old name, kept importable
RolloutSettings = RunnerSettings  # old name, kept importable
