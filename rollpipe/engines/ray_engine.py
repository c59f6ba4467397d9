"""RayEngine: any rollpipe engine hosted in a Ray actor, behind the same ``Engine``.

The actor (``EngineHost``) builds the engine with ``make_engine()`` in its own process,
with the resources you declare (``num_cpus``, ``num_gpus``, or any Ray actor option such
as a placement-group scheduling strategy for a tensor-parallel engine). The driver-side
``RayEngine`` is a ``BaseEngine`` whose backend forwards each call to the actor and
awaits the actor's reply on the engine's loop, so per-token logprobs and versions,
pause keep / abort / wait, resume, weight updates and close mean what they mean locally.

* **Weights** go through Ray's object store **once per update**: RayEngines made by one
  ``ray_pool`` share a ``WeightStore``, which ``ray.put``s the weights of a version once;
  every actor gets the same object reference and reads the tensors from shared memory
  on its node (zero-copy for the numpy-backed buffers Ray keeps).
* **Death**: an actor that dies (killed, crashed, its node lost) fails the requests
  waiting on it at once with ``EngineError`` naming the actor, and the engine counts as
  dead (``alive`` is False): an ``EnginePool`` then takes the rank out and re-sends its
  requests.
* **A stalled weight sync** (the actor never answers ``update_weights``) fails within
  ``update_weights_timeout_s`` with ``EngineError`` naming the actor and the version; the
  actor is killed and the engine is dead, so no later call waits on it either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rollpipe._utils.checks import check_timeout
from rollpipe._utils.ray_calls import ActorLost, ActorRaised, call_actor
from rollpipe.engines.backend import EngineLink
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.protocol import DEFAULT_UPDATE_WEIGHTS_TIMEOUT_S, Engine, PauseMode
from rollpipe.engines.records import EngineError, Generation, SamplingParams

__all__ = ["EngineHost", "RayEngine", "WeightStore", "ray_pool"]


class EngineHost:
    """The actor's body: one rollpipe engine in the actor's process."""

    def __init__(self, make_engine: Callable[[], Engine]) -> None:
        self.engine = make_engine()

    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        return await self.engine.generate(prompt, params)

    def pause(self, mode: PauseMode) -> None:
        self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def update_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> int:
        return self.engine.update_weights(named, version=version)

    def version(self) -> int:
        return self.engine.version

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.engine.close()


class WeightStore:
    """The object-store copy of the latest weights, put once per version and shared."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.ref: Any = None
        self.puts = 0  # how many times weights were copied into the object store

    def put(self, named: list[tuple[str, torch.Tensor]], version: int) -> Any:
        import ray

        if self.version != version or self.ref is None:
            self.ref, self.version = ray.put(named), version
            self.puts += 1
        return self.ref


class RayBackend:
    """Forwards every call to the engine's actor (see the module doc)."""

    vocab_size = None  # the hosted engine checks prompt ids
    features = frozenset({"top_logprobs", "structured_outputs"})  # the hosted engine checks them

    def __init__(
        self, actor: Any, link: EngineLink, store: WeightStore, update_timeout_s: float | None
    ) -> None:
        self.actor = actor
        self.link = link
        self.store = store
        self.update_timeout_s = update_timeout_s

    @classmethod
    async def start(
        cls,
        make_engine: Callable[[], Engine],
        options: Mapping[str, Any],
        link: EngineLink,
        store: WeightStore,
        update_timeout_s: float | None,
    ) -> RayBackend:
        import ray

        host: Any = ray.remote(EngineHost)  # an actor class (Ray's stubs type it loosely)
        actor = host.options(**options).remote(make_engine)
        try:
            version = await actor.version.remote()
        except Exception:
            ray.kill(actor)
            raise
        if version != link.version():
            ray.kill(actor)
            raise EngineError(f"RayEngine: the hosted engine starts at version {version}, not 0")
        return cls(actor, link, store, update_timeout_s)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await call_actor(self.actor, method, *args)
        except ActorLost as e:  # died, or unreachable
            error = EngineError(f"RayEngine: its actor died during {method}(): {e.error}")
            self.link.on_death(error)
            raise error from e
        except ActorRaised as e:  # the hosted engine raised: the request's own error
            cause = e.cause if e.cause is not None else e.error
            raise EngineError(f"RayEngine: the hosted engine's {method}() failed: {cause}") from e

    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        gen: Generation = await self._call("generate", prompt, params)
        return gen

    async def pause(self, mode: PauseMode) -> None:
        await self._call("pause", mode)

    async def resume(self) -> None:
        await self._call("resume")

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        update = self._call("update_weights", self.store.put(named, version), version)
        try:
            await asyncio.wait_for(update, self.update_timeout_s)
        except TimeoutError:  # _call turns the actor's own errors into EngineError
            import ray

            error = EngineError(
                f"RayEngine ({self.actor}): update_weights to version {version} got no answer "
                f"within update_weights_timeout_s={self.update_timeout_s} s; the actor was "
                "killed and this engine is dead (an EnginePool takes its rank out). Check the "
                "actor's log for what stalled, or raise update_weights_timeout_s for a model "
                "whose weights take longer to load"
            )
            self.link.on_death(error)
            ray.kill(self.actor, no_restart=True)
            raise error from None

    async def shutdown(self, error: BaseException) -> None:
        with contextlib.suppress(Exception):
            await self.actor.close.remote()

    def release(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


class RayEngine(BaseEngine):
    """``make_engine()`` (picklable; e.g. ``functools.partial(VLLMEngine, path)``) hosted in
    a Ray actor with ``num_cpus`` / ``num_gpus`` and any other ``actor_options``.

    Ray must be initialised (``ray.init(...)``), or Ray starts a local cluster itself.
    ``weights`` shares one object-store copy of each update between engines.
    ``update_weights_timeout_s`` (None: no limit) bounds one weight sync: past it the
    actor is killed and the engine is dead (see the module doc).
    """

    def __init__(
        self,
        make_engine: Callable[[], Engine],
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        actor_options: Mapping[str, Any] | None = None,
        weights: WeightStore | None = None,
        update_weights_timeout_s: float | None = DEFAULT_UPDATE_WEIGHTS_TIMEOUT_S,
    ) -> None:
        options = {"num_cpus": num_cpus, "num_gpus": num_gpus, **(actor_options or {})}
        timeout = check_timeout("RayEngine: update_weights_timeout_s", update_weights_timeout_s)
        self.weights = weights or WeightStore()
        super().__init__(name="rollpipe-ray-engine")
        self._attach(
            lambda link: RayBackend.start(make_engine, options, link, self.weights, timeout),
            f"a Ray actor ({options})",
        )

    @property
    def actor(self) -> Any:
        """The Ray actor hosting the engine."""
        backend: RayBackend = self._backend  # type: ignore[assignment]
        return backend.actor


def ray_pool(make_engine: Callable[[], Engine], num_engines: int = 2, **options: Any) -> EnginePool:
    """An ``EnginePool`` of ``RayEngine``s hosting ``make_engine()``, sharing one
    ``WeightStore`` (each update is put into the object store once). ``options`` go to
    ``RayEngine`` (``num_cpus``, ``num_gpus``, ``actor_options``) except the pool's
    (``devices``, ``router``, ``routing_log_size``)."""
    pool_keys = ("devices", "router", "routing_log_size")
    pool_options = {k: options.pop(k) for k in pool_keys if k in options}
    store = WeightStore()
    return EnginePool(
        lambda rank: RayEngine(make_engine, weights=store, **options), num_engines, **pool_options
    )
