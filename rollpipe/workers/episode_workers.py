"""EpisodeWorkers: the driver's side of N episode workers (``RunnerSettings.episode_workers``).

The EpisodeRunner keeps everything it does in-process — admission, its book of specs
admitted but not yet yielded (so checkpoints, order and group assembly are unchanged)
— and hands each episode to :meth:`EpisodeWorkers.run` instead of running it on its own
loop. The episode runs in a worker process (:class:`~rollpipe.workers.worker.EpisodeWorker`
hosted by a Ray actor), each with its own loop; only its engine requests come back: the
driver admits each one (``signals.admit``: a suspended pipeline holds it), generates it
on the pipeline's engine in the conversation's route (an ``EnginePool`` keeps the episode
on its rank) within ``generation_timeout_s``, and answers. Pauses of every mode,
``update_weights``, shrink / expand and staleness therefore mean what they mean
in-process, and the same seed gives the same rows (``env_ids`` aside: see
``ENV_IDS_PER_WORKER``).

Episodes go to the worker running the fewest. **A worker that dies** (its process
killed, its node lost) is replaced in its slot by a fresh actor, and each episode it was
running is **run again from its spec** — the same seed, so the same episode — on a live
worker: nothing is lost, and since its first run never reached the driver's book,
nothing is duplicated. An episode whose workers died ``max_reruns + 1`` times fails the
pipeline with :class:`WorkerLostError` naming it (a spec that kills every worker it
meets is a bug to see at once, not to retry forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import attrs

from rollpipe._utils.ray_calls import ActorLost
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.generation_timeout import answer_within
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.engines.protocol import Engine, engine_supports
from rollpipe.engines.routing import Route, in_route
from rollpipe.envs.pool import EnvForSpec
from rollpipe.workers.driver_engine import FEATURES
from rollpipe.workers.link import WorkerLink
from rollpipe.workers.mail import Abandon, Answer, Cancel, Finished, Request, Start
from rollpipe.workers.worker import WorkerHost

__all__ = ["DEFAULT_MAX_RERUNS", "EpisodeWorkers", "WorkerLostError", "workers_for"]

log = logging.getLogger(__name__)

DEFAULT_MAX_RERUNS = 2
"""Times one episode is run again after its worker died, before the pipeline fails."""


class RunnerSettingsLike(Protocol):
    """What :func:`workers_for` reads of ``rollpipe.nodes.rollout.RunnerSettings``."""

    @property
    def episode_workers(self) -> int: ...
    @property
    def worker_options(self) -> Mapping[str, Any]: ...
    @property
    def env_workers(self) -> int: ...
    @property
    def concurrency(self) -> int: ...


def workers_for(
    runner: RunnerSettingsLike,
    engine: Engine,
    chat: ChatFormat,
    settings: EpisodeSettings,
    env_factory: EnvForSpec | None,
    admit: Callable[[], Awaitable[None]] | None,
) -> EpisodeWorkers | None:
    """The workers an EpisodeRunner with ``runner`` settings runs its episodes in (not yet
    started), or None when ``runner.episode_workers`` is 0 (episodes on the engine's loop)."""
    if runner.episode_workers == 0:
        return None
    return EpisodeWorkers(
        runner.episode_workers,
        engine,
        chat,
        settings,
        env_factory,
        admit=admit,
        env_threads=runner.env_workers or runner.concurrency,
        env_calls_on_threads=runner.env_workers > 0,
        actor_options=dict(runner.worker_options),
    )


class WorkerLostError(RuntimeError):
    """An episode's worker died more often than ``max_reruns`` allows."""


@attrs.define(eq=False)
class _Episode:
    spec: EpisodeSpec
    done: asyncio.Future[Trajectory]
    link: WorkerLink | None = None
    runs: int = 0


class EpisodeWorkers:
    """N episode workers and the episodes they run; used on the driver's loop only.

    Args:
        count: workers (Ray actors, one process each).
        engine: the pipeline's engine; every request of every worker is made on it.
        chat, settings, env_factory: as for the EpisodeRunner (``env_factory`` must
            pickle: a module-level function, or one Ray can ship by value).
        admit: awaited before each request (``PipelineSignals.admit``).
        env_threads: threads per worker for blocking env calls.
        actor_options: Ray options for each worker actor (``num_cpus``, ``resources``,
            ``scheduling_strategy``...; default ``num_cpus=1``).
        max_reruns: see the module doc.
    """

    def __init__(
        self,
        count: int,
        engine: Engine,
        chat: ChatFormat,
        settings: EpisodeSettings,
        env_factory: EnvForSpec | None,
        *,
        admit: Callable[[], Awaitable[None]] | None,
        env_threads: int,
        env_calls_on_threads: bool = False,
        actor_options: dict[str, Any] | None = None,
        max_reruns: int = DEFAULT_MAX_RERUNS,
    ) -> None:
        self.count, self.engine, self.admit = count, engine, admit
        self.limit = settings.generation_timeout_s  # applied here, where pauses are known
        features = frozenset(f for f in FEATURES if engine_supports(engine, f))
        self._worker_args = (
            chat,
            attrs.evolve(settings, generation_timeout_s=None),
            env_factory,
            features,
            env_threads,
            env_calls_on_threads,
        )
        self._options = {"num_cpus": 1, **(actor_options or {})}
        self.max_reruns = max_reruns
        self._links: list[WorkerLink | None] = [None] * count
        self._episodes: dict[int, _Episode] = {}
        self._serving: dict[tuple[int, int], asyncio.Task[None]] = {}  # (slot, req)
        self._next_key = 0
        self.replaced = 0  # workers replaced after dying
        self.reruns = 0  # episodes run again after their worker died
        self._closed = False
        self.failure: WorkerLostError | None = None  # workers cannot start: every run fails

    # -- workers ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker (on the loop, where their links carry the mail)."""
        for slot in range(self.count):
            self._start_worker(slot)

    def _start_worker(self, slot: int) -> None:
        import ray

        host: Any = ray.remote(WorkerHost)  # an actor class (Ray's stubs type it loosely)
        actor = host.options(max_concurrency=4, **self._options).remote(slot, *self._worker_args)
        self._links[slot] = WorkerLink(slot, actor, self._on_mail, self._on_lost)

    @property
    def actors(self) -> list[Any]:
        """The live workers' actor handles, by slot (None where one is being replaced)."""
        return [None if link is None else link.actor for link in self._links]

    # -- episodes ----------------------------------------------------------------------------
    async def run(self, spec: EpisodeSpec) -> Trajectory:
        """Run ``spec``'s episode on a worker; cancelling this cancels it there."""
        key, self._next_key = self._next_key, self._next_key + 1
        episode = _Episode(spec, asyncio.get_running_loop().create_future())
        self._episodes[key] = episode
        self._place(key)
        try:
            return await asyncio.shield(episode.done)
        finally:
            self._drop(key)

    def _place(self, key: int) -> None:
        if self.failure is not None:
            self._episodes[key].done.set_exception(self.failure)
            return
        live = [link for link in self._links if link is not None and link.lost is None]
        episode = self._episodes[key]
        if not live:  # every slot's actor is started anew as soon as it is lost
            raise RuntimeError("EpisodeWorkers: no worker; call start() first")
        link = min(live, key=lambda one: (len(one.running), one.slot))
        episode.link, episode.runs = link, episode.runs + 1
        link.running.add(key)
        link.send(Start(key, episode.spec))

    def _drop(self, key: int) -> None:
        episode = self._episodes.pop(key, None)
        if episode is None or episode.link is None:
            return
        link = episode.link
        if key in link.running:  # cancelled on the driver: the worker drops it too
            link.running.discard(key)
            link.send(Cancel(key))

    # -- mail --------------------------------------------------------------------------------
    def _on_mail(self, link: WorkerLink, mail: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        for message in mail:
            if isinstance(message, Request):
                key = (link.slot, message.req)
                self._serving[key] = loop.create_task(self._serve(link, message))
                self._serving[key].add_done_callback(functools.partial(self._served, key))
            elif isinstance(message, Abandon):
                serving = self._serving.get((link.slot, message.req))
                if serving is not None:
                    serving.cancel()
            elif isinstance(message, Finished):
                self._finished(link, message)

    def _served(self, key: tuple[int, int], task: asyncio.Task[None]) -> None:
        self._serving.pop(key, None)

    def _finished(self, link: WorkerLink, message: Finished) -> None:
        link.running.discard(message.key)
        episode = self._episodes.get(message.key)
        if episode is None or episode.link is not link or episode.done.done():
            return  # cancelled meanwhile, or a run from before a replacement
        if message.error is not None:
            episode.done.set_exception(message.error)
        else:
            assert message.trajectory is not None
            episode.done.set_result(message.trajectory)

    async def _serve(self, link: WorkerLink, request: Request) -> None:
        """Admit, generate in the request's route, answer (the error too)."""
        route = None if request.route_key is None else Route(request.route_key, request.route_rank)
        try:
            if self.admit is not None:
                await self.admit()
            # engines written before images keep working: the keyword only when used
            kwargs: dict[str, Any] = {"images": request.images} if request.images else {}
            with in_route(route) if route is not None else contextlib.nullcontext():
                # awaited inside: the pool reads the route in the request's own task
                call = self.engine.generate(request.prompt, request.params, **kwargs)
                gen = await answer_within(self.engine, call, self.limit)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            answer = Answer(request.req, None, error, None if route is None else route.rank)
        else:
            answer = Answer(request.req, gen, None, None if route is None else route.rank)
        link.send(answer)

    def _on_lost(self, link: WorkerLink, error: BaseException) -> None:
        """A worker died: cancel its requests, replace it, run its episodes again."""
        if self._closed:
            return
        for (slot, _req), task in list(self._serving.items()):
            if slot == link.slot:
                task.cancel()
        orphans = sorted(link.running)
        link.running.clear()
        if isinstance(error, ActorLost) and error.init_failed:  # no worker can start
            self._fail_all(WorkerLostError(f"an episode worker could not start: {error}"))
            return
        log.warning("episode worker %d lost (%s); replacing it", link.slot, error)
        self.replaced += 1
        self._start_worker(link.slot)
        for key in orphans:
            episode = self._episodes.get(key)
            if episode is None or episode.done.done():
                continue
            if episode.runs > self.max_reruns:
                spec = episode.spec
                episode.done.set_exception(
                    WorkerLostError(
                        f"episode {spec.episode_id} (group {spec.group_id}, seed {spec.seed}, "
                        f"env {spec.env_name!r}) lost its worker {episode.runs} times "
                        f"(max_reruns={self.max_reruns}); the last: {error}"
                    )
                )
                continue
            self.reruns += 1
            self._place(key)

    def _fail_all(self, error: WorkerLostError) -> None:
        self.failure = error
        for episode in self._episodes.values():
            if not episode.done.done():
                episode.done.set_exception(error)

    # -- lifecycle ---------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop the links and kill the workers (on the loop)."""
        import ray

        self._closed = True
        links = [link for link in self._links if link is not None]
        self._links = [None] * self.count
        for task in self._serving.values():
            task.cancel()
        for link in links:
            await link.stop()
            with contextlib.suppress(Exception):  # already gone
                ray.kill(link.actor, no_restart=True)
