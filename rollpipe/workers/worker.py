"""EpisodeWorker: the episode loop in a worker process (hosted by a Ray actor).

A worker runs the episodes the driver sends it exactly as the driver would
(:func:`~rollpipe.envs.pool.run_spec`: env calls, chat and dialog rendering,
tokenization, tool calls, agents with their ``openai`` clients and their front door), on
its own :class:`~rollpipe.runtime.Runtime` — the one loop of its process — with a
:class:`~rollpipe.workers.driver_engine.DriverEngine` as their engine. The driver keeps
admission, routing, group assembly, collation and checkpoints.

Two calls carry the mail (:mod:`rollpipe.workers.mail`): ``push(messages)`` delivers the
driver's and returns at once; ``pull()`` returns every message the worker has for the
driver, waiting (on the loop, woken by an event, never polling) until there is one. The
actor is threaded so a ``pull`` in wait never holds back a ``push``; each call hops onto
the loop through the worker's scope, the one bridge. (The actor's class,
:class:`WorkerHost`, has no coroutine methods: Ray would make it an asyncio actor, and a
``pull`` in wait would then block its loop and every ``push`` behind it.)
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.env_threads import EnvThreads
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import Trajectory
from rollpipe.envs.pool import EnvForSpec, EnvPool, run_spec
from rollpipe.runtime import Runtime
from rollpipe.workers.driver_engine import DriverEngine
from rollpipe.workers.mail import Answer, Cancel, Finished, Start

__all__ = ["ENV_IDS_PER_WORKER", "EpisodeWorker", "WorkerHost"]

ENV_IDS_PER_WORKER = 1 << 20
"""Rows' ``env_ids`` from worker slot ``i`` are ``i * ENV_IDS_PER_WORKER + `` the id in its
own env pool, so ids of different workers never collide."""


class EpisodeWorker:
    """Runs episodes for the driver; see the module doc.

    Args:
        slot: the worker's slot (0 .. N-1), kept by its replacement.
        chat: the pipeline's :class:`ChatFormat` (pickled as its settings).
        settings: the :class:`EpisodeSettings`, with ``generation_timeout_s`` left to the
            driver.
        env_factory: builds an env for a spec (None: the registry of this process).
        features: what the driver's engine supports (``DriverEngine``).
        env_threads: threads for blocking env calls.
        env_calls_on_threads: send even ``blocking = False`` envs to the threads.
    """

    def __init__(
        self,
        slot: int,
        chat: ChatFormat,
        settings: EpisodeSettings,
        env_factory: EnvForSpec | None,
        features: frozenset[str],
        env_threads: int,
        env_calls_on_threads: bool = False,
    ) -> None:
        self.slot, self.chat, self.settings = slot, chat, settings
        self.runtime = Runtime(f"rollpipe-episode-worker-{slot}")
        self._scope = self.runtime.scope("EpisodeWorker")
        self.engine = DriverEngine(self.runtime, features, self._send)
        self._envs = EnvPool(env_factory)
        self._threads = EnvThreads(env_threads, "rollpipe-worker-env")
        self._on_threads = env_calls_on_threads
        self._episodes: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[Any] = []
        self._mail = asyncio.Event()  # used on the loop only
        self.started = 0  # episodes started (a monitoring count)

    # -- from the actor's threads -----------------------------------------------------------
    def push(self, messages: list[Any]) -> None:
        """Deliver the driver's messages."""
        self._scope.call(self._deliver(messages))

    def pull(self) -> list[Any]:
        """Every message for the driver, once there is at least one."""
        return self._scope.call(self._take())

    def stats(self) -> dict[str, int]:
        """Episodes running now and started so far, and this process's id."""
        return {
            "running": len(self._episodes),
            "started": self.started,
            "outbox": len(self._outbox),
            "pid": os.getpid(),
        }

    def close(self) -> None:
        """Cancel the episodes, close the envs and the loop."""
        if self.runtime.alive:
            self._scope.call(self._stop())
        self._scope.close()
        self._threads.close(0.0)
        try:
            self._envs.close()
        finally:
            self.runtime.close()

    # -- on the loop -------------------------------------------------------------------------
    async def _deliver(self, messages: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        for message in messages:
            if isinstance(message, Answer):
                self.engine.answered(message)
            elif isinstance(message, Start):
                self.started += 1
                self._episodes[message.key] = loop.create_task(self._run(message))
            elif isinstance(message, Cancel):
                task = self._episodes.pop(message.key, None)
                if task is not None:
                    task.cancel()
            else:
                raise TypeError(f"EpisodeWorker: unknown message {message!r}")

    async def _take(self) -> list[Any]:
        while not self._outbox:
            self._mail.clear()
            await self._mail.wait()
        taken, self._outbox = self._outbox, []
        return taken

    def _send(self, message: Any) -> None:
        self._outbox.append(message)
        self._mail.set()

    async def _run(self, start: Start) -> None:
        trajectory: Trajectory | None = None
        error: BaseException | None = None
        try:
            trajectory = await run_spec(
                start.spec,
                self._envs,
                self.engine,
                self.chat,
                self.settings,
                admit=None,  # the driver admits each request
                env_threads=self._threads,
                env_calls_on_threads=self._on_threads,
                env_id_offset=self.slot * ENV_IDS_PER_WORKER,
            )
        except asyncio.CancelledError:
            return  # cancelled by the driver: it expects nothing back
        except Exception as exc:  # an engine error, a re-raised env error: the driver's to see
            error = exc
        finally:
            if self._episodes.get(start.key) is asyncio.current_task():
                del self._episodes[start.key]
        self._send(Finished(start.key, trajectory, error))

    async def _stop(self) -> None:
        tasks = list(self._episodes.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._episodes.clear()
        self.engine.close()


class WorkerHost:
    """The Ray actor of one :class:`EpisodeWorker` (threaded: see the module doc)."""

    def __init__(self, *args: Any) -> None:
        self.worker = EpisodeWorker(*args)

    def push(self, messages: list[Any]) -> None:
        self.worker.push(messages)

    def pull(self) -> list[Any]:
        return self.worker.pull()

    def stats(self) -> dict[str, int]:
        return self.worker.stats()

    def close(self) -> None:
        self.worker.close()
