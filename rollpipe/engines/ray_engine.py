"""RayEngine: any rollpipe engine hosted in a Ray actor, behind the same ``Engine``.

The actor (``EngineHost``) builds the engine with ``make_engine()`` in its own process,
with the resources you declare (``num_cpus``, ``num_gpus``, or any Ray actor option such
as a placement-group scheduling strategy for a tensor-parallel engine). The driver-side
``RayEngine`` is a ``BaseEngine`` whose backend forwards each call to the actor and
awaits the actor's reply on the engine's loop, so per-token logprobs and versions,
pause keep / abort / wait, resume, weight updates and close mean what they mean locally.

* **Weights** go through Ray's object store **once per update**: RayEngines made by one
  ``ray_pool`` share a ``WeightStore``, which ``ray.put``s the weights of an update once;
  every actor gets the same object reference and reads the tensors from shared memory
  on its node (zero-copy for the numpy-backed buffers Ray keeps).
* **Or by broadcast** (``weight_sync="broadcast"``): the trainer sends each update over a
  ``torch.distributed`` group of itself and the hosts (gloo on CPU, NCCL on GPU), the
  way verl, ROLL and slime do; ``weight_broadcast.py`` has the protocol and its failures.
  The object store stays the default: it needs no group (no port between the trainer and
  the hosts, nothing to re-form when an engine dies or comes back), and on one machine
  it is already a copy through shared memory (docs/scaling-out.md has both measured).
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
import weakref
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
from rollpipe.engines.weight_broadcast import (
    WEIGHT_SYNCS,
    BroadcastChannel,
    GroupSpec,
    Member,
    WeightReceiver,
    WeightsMessage,
)

__all__ = ["BroadcastChannel", "EngineHost", "RayEngine", "WeightStore", "ray_pool"]


class EngineHost:
    """The actor's body: one rollpipe engine in the actor's process."""

    def __init__(self, make_engine: Callable[[], Engine]) -> None:
        self.engine = make_engine()
        self.receiver: WeightReceiver | None = None  # its member of a weight broadcast group

    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        return await self.engine.generate(prompt, params)

    def pause(self, mode: PauseMode) -> None:
        self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def update_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> int:
        return self.engine.update_weights(named, version=version)

    async def join_weight_group(self, spec: GroupSpec) -> None:
        """Join a ``BroadcastChannel``'s group as ``spec.rank`` (replacing an older one)."""
        self.receiver = await asyncio.to_thread(WeightReceiver, spec)

    async def receive_weights(self, message: WeightsMessage) -> int:
        """Receive one broadcast update and load it with the engine's ``update_weights``."""
        receiver = self.receiver
        if receiver is None:
            raise RuntimeError("receive_weights before join_weight_group: no group to receive on")

        def receive_and_load() -> int:  # off the actor's loop: generate calls still come in
            named = receiver.receive(message)
            return self.engine.update_weights(named, version=message.version)

        return await asyncio.to_thread(receive_and_load)

    def version(self) -> int:
        return self.engine.version

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.engine.close()


class WeightStore:
    """The object-store copy of the latest weights, put once per update and shared.

    The ranks of a pool load one update from one ``ray.put``. An update is the same as
    the stored one when it has the same version and the very same tensors, unchanged
    since (each tensor's in-place ``_version`` counter): a second update with the same
    explicit version but other tensors, or the same tensors stepped in place, is put
    again, never served the stale copy. Tensors are watched through weak references, so
    the store keeps none of the trainer's tensors alive.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.ref: Any = None
        self.puts = 0  # how many times weights were copied into the object store
        self._source: list[tuple[str, weakref.ref[torch.Tensor], int]] = []

    def put(self, named: list[tuple[str, torch.Tensor]], version: int) -> Any:
        import ray

        if self.ref is None or self.version != version or not self._holds(named):
            self.ref, self.version = ray.put(named), version
            self._source = [(name, weakref.ref(t), t._version) for name, t in named]
            self.puts += 1
        return self.ref

    def _holds(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``named`` is the stored update: the same names, tensor objects and
        in-place versions."""
        return len(named) == len(self._source) and all(
            name == kept and ref() is t and t._version == seen
            for (name, t), (kept, ref, seen) in zip(named, self._source, strict=True)
        )


class RayBackend:
    """Forwards every call to the engine's actor (see the module doc)."""

    vocab_size = None  # the hosted engine checks prompt ids
    features = frozenset({"top_logprobs", "structured_outputs"})  # the hosted engine checks them

    def __init__(
        self,
        actor: Any,
        link: EngineLink,
        store: WeightStore | BroadcastChannel,
        update_timeout_s: float | None,
    ) -> None:
        self.actor = actor
        self.link = link
        self.store = store
        self.update_timeout_s = update_timeout_s
        self.member: Member | None = None  # its place in a BroadcastChannel
        if isinstance(store, BroadcastChannel):
            self.member = store.join(actor, link.on_death)

    @classmethod
    async def start(
        cls,
        make_engine: Callable[[], Engine],
        options: Mapping[str, Any],
        link: EngineLink,
        store: WeightStore | BroadcastChannel,
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
            self._died(error)
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

    def _died(self, error: BaseException) -> None:
        self.link.on_death(error)
        if self.member is not None and isinstance(self.store, BroadcastChannel):
            self.store.leave(self.member)

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        store = self.store
        if isinstance(store, BroadcastChannel):
            assert self.member is not None  # joined in __init__
            # off the loop: the channel blocks on the collectives, each within the timeout
            timeout = self.update_timeout_s
            await asyncio.to_thread(store.deliver, self.member, named, version, timeout)
            return
        update = self._call("update_weights", store.put(named, version), version)
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
            self._died(error)
            ray.kill(self.actor, no_restart=True)
            raise error from None

    async def shutdown(self, error: BaseException) -> None:
        if self.member is not None and isinstance(self.store, BroadcastChannel):
            self.store.leave(self.member)
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
    ``weight_sync`` is how updates reach the actor: ``"object_store"`` (default; a
    ``WeightStore``) or ``"broadcast"`` (a ``BroadcastChannel``: a ``torch.distributed``
    group of the trainer and the hosts). ``weights`` shares one store or channel between
    engines (``ray_pool`` does); its kind must be ``weight_sync``'s.
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
        weights: WeightStore | BroadcastChannel | None = None,
        update_weights_timeout_s: float | None = DEFAULT_UPDATE_WEIGHTS_TIMEOUT_S,
        weight_sync: str = "object_store",
    ) -> None:
        options = {"num_cpus": num_cpus, "num_gpus": num_gpus, **(actor_options or {})}
        timeout = check_timeout("RayEngine: update_weights_timeout_s", update_weights_timeout_s)
        self.weights = _weight_path(weight_sync, weights)
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


def _weight_path(
    weight_sync: str, weights: WeightStore | BroadcastChannel | None
) -> WeightStore | BroadcastChannel:
    """The store or channel a RayEngine's updates go through, checked against the knob."""
    if weight_sync not in WEIGHT_SYNCS:
        raise ValueError(
            f"RayEngine: weight_sync={weight_sync!r}; choose 'object_store' (the default: "
            "through Ray's object store) or 'broadcast' (a torch.distributed group)"
        )
    kind = WeightStore if weight_sync == "object_store" else BroadcastChannel
    if weights is None:
        return kind()
    if not isinstance(weights, kind):
        raise ValueError(
            f"RayEngine: weights is a {type(weights).__name__} but weight_sync={weight_sync!r} "
            f"needs a {kind.__name__}; pass one of those, or leave weights out"
        )
    return weights


def ray_pool(make_engine: Callable[[], Engine], num_engines: int = 2, **options: Any) -> EnginePool:
    """An ``EnginePool`` of ``RayEngine``s hosting ``make_engine()``, sharing one
    ``WeightStore`` (each update is put into the object store once) or, with
    ``weight_sync="broadcast"``, one ``BroadcastChannel`` (each update is broadcast once
    to every live rank). ``options`` go to ``RayEngine`` (``num_cpus``, ``num_gpus``,
    ``actor_options``, ``weight_sync``, ``update_weights_timeout_s``) except the pool's
    (``devices``, ``router``, ``routing_log_size``)."""
    pool_keys = ("devices", "router", "routing_log_size")
    pool_options = {k: options.pop(k) for k in pool_keys if k in options}
    store = _weight_path(options.get("weight_sync", "object_store"), None)
    return EnginePool(
        lambda rank: RayEngine(make_engine, weights=store, **options), num_engines, **pool_options
    )
