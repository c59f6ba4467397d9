"""Weight sync by broadcast: the trainer sends each update to every Ray engine host over
one ``torch.distributed`` process group (gloo for CPU tensors, NCCL for CUDA ones).

This is the path verl, ROLL and slime take (vLLM's RLHF example: a group with the
trainer as rank 0 and the inference workers after it), beside ``WeightStore``'s path
through Ray's object store. A ``BroadcastChannel`` is shared by the ``RayEngine``s of one
``ray_pool(..., weight_sync="broadcast")`` (or owned by one ``RayEngine``):

* **The group** is formed at the first update, and again whenever the live engines
  change (one died, one was added by ``expand``): the trainer opens a ``TCPStore`` on a
  free port of its node, each host joins as rank 1..N (``EngineHost.join_weight_group``)
  and the trainer is rank 0. No global ``torch.distributed`` state is touched: the
  group is a bare ``ProcessGroupGloo`` / ``ProcessGroupNCCL``, so a process may hold
  several channels, and a trainer's own ``init_process_group`` is left alone.
* **An update** checks the weights against the channel's layout (the names, shapes
  and dtypes of its first update: an unknown name or another shape is refused before
  anything is sent), sends each host the small ``WeightsMessage`` (names, shapes,
  dtypes, version, buckets) as a Ray call, then broadcasts the tensors packed into
  byte buckets of at most ``bucket_bytes`` (one collective per bucket rather than per
  tensor); each host unpacks views of its buckets and loads them with its engine's own
  ``update_weights``. The first ``RayEngine`` of the pool whose ``update_weights`` runs
  sends to all of them; the others find their host's outcome already there.
* **Failures** never hang the trainer: each host's answer is awaited within the engines'
  ``update_weights_timeout_s``, and every collective (one bucket, or the rendezvous) has
  half of it as the group's timeout, so a host that gives up still answers in time. A
  host whose actor died is named in the error and its engine is marked dead (an
  ``EnginePool`` takes its rank out); a host that stalls past the limit is killed, as
  on the object-store path. After any failure the group is dropped and the next update
  forms a new one with the live engines. A host that was still waiting for its data
  when the trainer's send failed gives up at the group's timeout (gloo cannot wake a
  waiting receive), so the failed update returns after about half of
  ``update_weights_timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import itertools
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from rollpipe._utils.ray_calls import ActorLost, ActorRaised, ray_text
from rollpipe.engines.records import EngineError
from rollpipe.engines.weight_buckets import (
    TensorSpec,
    WeightsMessage,
    pack_bucket,
    plan_message,
    unpack_buckets,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "WEIGHT_SYNCS",
    "BroadcastChannel",
    "GroupSpec",
    "Member",
    "TensorSpec",
    "WeightReceiver",
    "WeightsMessage",
    "pack_bucket",
    "plan_message",
    "unpack_buckets",
]

WEIGHT_SYNCS = ("object_store", "broadcast")
DEFAULT_BUCKET_BYTES = 256 << 20
_DEFAULT_TIMEOUT_S = 600.0  # when the engines set no update_weights_timeout_s


@attrs.frozen
class GroupSpec:
    """How a host joins the channel's group: the trainer's store, its rank, the size."""

    address: str
    port: int
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    prefix: str  # the store's key prefix for this group (a new one per group)


def _process_group(store: Any, spec: GroupSpec) -> Any:
    """A bare process group (no global torch.distributed state) on ``store``."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(spec.prefix, store)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, options)
    return dist.ProcessGroupGloo(prefixed, spec.rank, spec.world_size, timeout)


def _device(backend: str) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # NCCL work completes on a stream: wait for it here
        torch.cuda.synchronize(device)


class WeightReceiver:
    """A host's side of the channel: its member of the group, and the receive."""

    def __init__(self, spec: GroupSpec) -> None:
        import torch.distributed as dist

        store = dist.TCPStore(
            spec.address,
            spec.port,
            spec.world_size,
            False,
            timeout=datetime.timedelta(seconds=spec.timeout_s),
        )
        self.spec = spec
        self.device = _device(spec.backend)
        self.group = _process_group(store, spec)
        self._store = store  # kept alive with the group

    def receive(self, message: WeightsMessage) -> list[tuple[str, torch.Tensor]]:
        """Receive every bucket of ``message`` from rank 0; the named tensors, unpacked."""
        buffers = []
        for size in message.bucket_bytes:
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.group.broadcast(buffer, 0).wait()
            buffers.append(buffer)
        _synchronize(self.device)
        return unpack_buckets(buffers, message)


@attrs.define(eq=False)
class Member:
    """One engine host of a channel: its actor, and how to tell its engine it died."""

    actor: Any
    on_death: Callable[[BaseException], None]
    number: int  # the order it joined the channel in, to name it
    left: bool = False  # its engine closed or died: no longer sent to

    def describe(self) -> str:
        return f"engine host #{self.number} ({self.actor})"


@attrs.define
class _Group:
    members: tuple[Member, ...]
    backend: str
    group: Any
    store: Any


class BroadcastChannel:
    """The trainer's side of weight sync by broadcast (see the module doc).

    ``bucket_bytes`` bounds one collective's buffer (the trainer packs small tensors
    into it; the hosts receive into buffers of the same sizes). ``broadcasts`` and
    ``groups_formed`` count what the channel did.
    """

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(
                f"BroadcastChannel: bucket_bytes must be an int >= 1, got {bucket_bytes!r}"
            )
        self.bucket_bytes = bucket_bytes
        self.broadcasts = 0  # updates sent (each to every live host)
        self.groups_formed = 0
        self._members: list[Member] = []
        self._numbers = itertools.count()
        self._lock = threading.Lock()  # one update at a time
        self._group: _Group | None = None
        self._layout: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._results: dict[Member, EngineError | None] = {}
        self._results_key: Any = None

    def join(self, actor: Any, on_death: Callable[[BaseException], None]) -> Member:
        """Add an engine host; the next update forms a group that includes it."""
        member = Member(actor, on_death, next(self._numbers))
        with self._lock:
            self._members.append(member)
        return member

    def leave(self, member: Member) -> None:
        """Stop sending to ``member`` (its engine closed or died); lock-free, any thread."""
        member.left = True

    @property
    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """``{name: (shape, dtype)}`` of the first update (None before it)."""
        return None if self._layout is None else dict(self._layout)

    # -- one update ----------------------------------------------------------------------
    def deliver(
        self,
        member: Member,
        named: Sequence[tuple[str, torch.Tensor]],
        version: int,
        timeout_s: float | None,
    ) -> None:
        """Get ``named`` at ``version`` loaded on ``member``'s host: broadcast it to every
        live host unless this update already reached it. Blocks (run it off the loop);
        raises ``EngineError`` naming the host if it did not load (ValueError for weights
        that do not match the layout, before anything is sent)."""
        key = (version, tuple((n, t.data_ptr(), tuple(t.shape)) for n, t in named))
        with self._lock:
            if member.left:
                raise EngineError(f"{member.describe()} left the weight channel (closed or dead)")
            if self._results_key != key or member not in self._results:
                self._broadcast(named, version, key, timeout_s or _DEFAULT_TIMEOUT_S, timeout_s)
            if member not in self._results:
                raise EngineError(f"{member.describe()} was not sent version {version}")
            outcome = self._results.pop(member)
        if outcome is not None:
            raise outcome

    def _check_layout(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"update_weights (weight_sync='broadcast'): duplicate names {dupes}")
        if self._layout is None:
            return
        wrong = []
        for name, t in named:
            want = self._layout.get(name)
            if want is None:
                wrong.append(f"{name!r} is not a weight of the layout")
            elif (tuple(t.shape), t.dtype) != want:
                wrong.append(
                    f"{name!r} is {tuple(t.shape)} {t.dtype}, the layout has {want[0]} {want[1]}"
                )
        if wrong:
            raise ValueError(
                f"update_weights (weight_sync='broadcast'): {len(wrong)} of {len(named)} "
                f"weights do not match the layout of the channel's first update "
                f"({len(self._layout)} weights): {'; '.join(wrong[:5])}; nothing was sent "
                "to any engine. Send weights named and shaped as that first update (a state "
                "dict of the same model), or build new engines for another model"
            )

    def _broadcast(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        version: int,
        key: Any,
        limit: float,
        timeout_s: float | None,
    ) -> None:
        """Send one update to every live host; record each host's outcome."""
        self._check_layout(named)
        self._members = [m for m in self._members if not m.left]
        recipients = tuple(self._members)
        backend = "nccl" if any(t.is_cuda for _, t in named) else "gloo"
        message = plan_message(named, version, self.bucket_bytes)
        self._results, self._results_key = {}, key
        outcomes = self._form_group(recipients, backend, limit)
        if outcomes is None:
            outcomes = self._send(named, message, recipients, limit)
        failed = {m: e for m, e in outcomes.items() if e is not None}
        if failed:
            self._drop_group()
        self._results = self._errors(outcomes, version, timeout_s)
        self.broadcasts += 1
        if self._layout is None and len(failed) < len(recipients):
            self._layout = {n: (tuple(t.shape), t.dtype) for n, t in named}

    def _form_group(
        self, recipients: tuple[Member, ...], backend: str, limit: float
    ) -> dict[Member, BaseException | None] | None:
        """The group of the trainer and ``recipients`` (kept if it is that one already);
        None when it stands, else each host's failure to join."""
        group = self._group
        if group is not None and group.members == recipients and group.backend == backend:
            return None
        self._drop_group()
        import ray
        import torch.distributed as dist

        world = len(recipients) + 1
        address = ray.util.get_node_ip_address()
        store = dist.TCPStore(
            address,
            0,
            world,
            True,
            timeout=datetime.timedelta(seconds=_collective_s(limit)),
            wait_for_workers=False,
        )
        prefix = f"rollpipe-weights/{uuid.uuid4().hex}"
        specs = [
            GroupSpec(address, store.port, i + 1, world, backend, _collective_s(limit), prefix)
            for i in range(world - 1)
        ]
        refs = [m.actor.join_weight_group.remote(s) for m, s in zip(recipients, specs, strict=True)]
        trainer = GroupSpec(address, store.port, 0, world, backend, _collective_s(limit), prefix)
        with concurrent.futures.ThreadPoolExecutor(1, "rollpipe-weight-group") as pool:
            made = pool.submit(_process_group, store, trainer)  # blocks until all joined
            outcomes = _answers(recipients, refs, "join_weight_group", limit)
            try:
                pg = made.result(timeout=limit)
            except Exception as e:  # a host missing: its own answer says why
                pg = None
                for m in recipients:
                    outcomes[m] = outcomes[m] or e
        if any(e is not None for e in outcomes.values()) or pg is None:
            return outcomes
        self._group = _Group(recipients, backend, pg, store)
        self.groups_formed += 1
        return None

    def _send(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        message: WeightsMessage,
        recipients: tuple[Member, ...],
        limit: float,
    ) -> dict[Member, BaseException | None]:
        """The message to each host, then the buckets over the group; each host's answer."""
        assert self._group is not None
        group = self._group
        device = _device(group.backend)
        refs = [m.actor.receive_weights.remote(message) for m in recipients]
        sent: BaseException | None = None
        try:
            for bucket in range(len(message.bucket_bytes)):
                group.group.broadcast(pack_bucket(named, message, bucket, device), 0).wait()
            _synchronize(device)
        except Exception as e:  # a host died or stalled: the answers say which
            sent = e
        outcomes = _answers(recipients, refs, "receive_weights", limit)
        if sent is not None:  # a host that says it loaded did; the group is broken
            self._drop_group()
        return outcomes

    def _errors(
        self,
        outcomes: dict[Member, BaseException | None],
        version: int,
        timeout_s: float | None,
    ) -> dict[Member, EngineError | None]:
        """Each host's outcome as its engine's error; a dead host's engine is told now."""
        dead = [m for m, e in outcomes.items() if isinstance(e, ActorLost)]
        because = (
            f" (the broadcast failed because {', '.join(m.describe() for m in dead)} died)"
            if dead
            else ""
        )
        retry = (
            "; this engine kept its weights and version: call update_weights again, the "
            "channel forms a new group with the live engines"
        )
        errors: dict[Member, EngineError | None] = {}
        for member, e in outcomes.items():
            what = f"RayEngine ({member.describe()}): the weight broadcast of version {version}"
            if e is None:
                errors[member] = None
            elif isinstance(e, ActorLost):
                died = EngineError(f"{what}: its actor died: {ray_text(e.error)}")
                errors[member], member.left = died, True
                member.on_death(died)
            elif isinstance(e, TimeoutError):
                import ray

                stalled = EngineError(
                    f"{what} got no answer within update_weights_timeout_s={timeout_s} s; the "
                    "actor was killed and this engine is dead (an EnginePool takes its rank "
                    "out). Check the actor's log for what stalled, or raise "
                    "update_weights_timeout_s for a model whose weights take longer to load"
                )
                errors[member], member.left = stalled, True
                member.on_death(stalled)
                with contextlib.suppress(Exception):
                    ray.kill(member.actor, no_restart=True)
            else:
                cause = e.cause if isinstance(e, ActorRaised) and e.cause is not None else e
                errors[member] = EngineError(f"{what} failed on the host: {cause}{because}{retry}")
        return errors

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(Exception):
                group.group.shutdown()

    def close(self) -> None:
        """Drop the group (the hosts' side goes with their actors)."""
        with self._lock:
            self._drop_group()


def _collective_s(limit: float) -> float:
    """The group's timeout for one collective (one bucket, or the rendezvous): half the
    limit on the whole update, so that a host whose receive gives up answers (with its
    error) before the trainer stops waiting for it and counts it as stalled."""
    return limit / 2


def _answers(
    members: Sequence[Member], refs: Sequence[Any], method: str, limit: float
) -> dict[Member, BaseException | None]:
    """Each host call's outcome within ``limit`` s: None, ``ActorLost``, ``ActorRaised``
    or ``TimeoutError`` (the same distinction ``call_actor`` makes, from a thread)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    deadline = datetime.datetime.now() + datetime.timedelta(seconds=limit)
    outcomes: dict[Member, BaseException | None] = {}
    for member, ref in zip(members, refs, strict=True):
        left = max(0.0, (deadline - datetime.datetime.now()).total_seconds())
        try:
            ray.get(ref, timeout=left)
            outcomes[member] = None
        except GetTimeoutError:
            outcomes[member] = TimeoutError(f"{member.describe()}: no answer within {limit} s")
        except RayActorError as e:
            outcomes[member] = ActorLost(method, e)
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else None
            outcomes[member] = ActorRaised(method, cause, e)
    return outcomes
