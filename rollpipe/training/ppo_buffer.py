"""RolloutBuffer: one preallocated rollout ``TensorDict`` for classic on-policy RL (PPO).

A collector writes ``N`` environments x ``T`` steps into a shared ``[N, T + 1]`` TensorDict
that is allocated once on ``device``. The last time index holds the final observation and
its bootstrap value; for transition-only fields it is padding, so every field shares the
``[N, T + 1]`` batch shape. ``transition_view`` turns that storage into aligned ``[N, T]``
(or flattened ``[N * T]``) transitions and ``iterate_minibatches`` shuffles those for the
update epochs.

Lifecycle: ``start_rollout()`` -> writes (``write(t, ...)`` is the checked API) -> ``add()``
-> ``get()`` (consumes). Views alias the shared storage: they stay valid until the next
``start_rollout()``; ``clone()`` one to keep it longer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import torch
from tensordict import TensorDict, TensorDictBase

from rollpipe._utils.checks import check_int

__all__ = [
    "NEXT_VALUE_KEY",
    "STATE_FIELDS",
    "TRANSITION_FIELDS",
    "RolloutBuffer",
    "RolloutBufferError",
    "is_transition_view",
    "iterate_minibatches",
    "transition_view",
]

#: Fields whose last time slot is real data (final observation, bootstrap value).
STATE_FIELDS: Final = ("obs", "value")
#: Fields describing the transition taken at step ``t``; their last slot is padding.
#: ``final_value`` is a rollpipe extension: V(final observation) of an episode truncated at
#: step ``t`` (0 elsewhere), so GAE can bootstrap through time-limit truncation.
TRANSITION_FIELDS: Final = (
    "action",
    "sample_log_prob",
    "reward",
    "done",
    "terminated",
    "truncated",
    "final_value",
)
#: Key that ``transition_view`` adds (``value[:, 1:]``); its presence marks a view.
NEXT_VALUE_KEY: Final = "next_value"

_IDLE, _WRITING, _READY = "idle", "writing", "ready"


class RolloutBufferError(RuntimeError):
    """Raised when the buffer's lifecycle is misused (add without start, get before add...)."""


class RolloutBuffer:
    """Preallocated ``[num_envs, rollout_len + 1]`` rollout storage on ``device``.

    Fields: ``obs`` float32 ``[N, T+1, obs_dim]``, ``action`` float32 ``[N, T+1, action_dim]``,
    ``sample_log_prob``/``value``/``reward``/``final_value`` float32 ``[N, T+1]``,
    ``done``/``terminated``/``truncated`` bool ``[N, T+1]``. Discrete actions are stored as
    float32 indices with ``action_dim=1``.

    Examples:
        >>> buffer = RolloutBuffer(num_envs=2, rollout_len=3, obs_dim=4, action_dim=1)
        >>> rollout = buffer.start_rollout()
        >>> for t in range(3):
        ...     buffer.write(t, obs=torch.randn(2, 4), reward=torch.ones(2), value=torch.zeros(2))
        >>> buffer.write(3, obs=torch.randn(2, 4), value=torch.zeros(2))  # final obs, bootstrap
        >>> buffer.add(rollout); buffer.state
        'ready'
        >>> batch = buffer.get()  # consumed: flat transitions, next_value attached
        >>> batch.batch_size, batch["next_value"].shape, buffer.state
        (torch.Size([6]), torch.Size([6]), 'idle')
    """

    def __init__(
        self,
        num_envs: int,
        rollout_len: int,
        obs_dim: int,
        action_dim: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_envs = check_int("RolloutBuffer.num_envs", num_envs, 1)
        self.rollout_len = check_int("RolloutBuffer.rollout_len", rollout_len, 1)
        self.obs_dim = check_int("RolloutBuffer.obs_dim", obs_dim, 1)
        self.action_dim = check_int("RolloutBuffer.action_dim", action_dim, 1)
        self.device = torch.device(device)
        n, t1 = num_envs, rollout_len + 1
        f32, b = torch.float32, torch.bool
        # field -> (dtype, feature shape)
        self.schema: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            "obs": (f32, (obs_dim,)),
            "action": (f32, (action_dim,)),
            "sample_log_prob": (f32, ()),
            "value": (f32, ()),
            "reward": (f32, ()),
            "final_value": (f32, ()),
            "done": (b, ()),
            "terminated": (b, ()),
            "truncated": (b, ()),
        }
        self._rollout = TensorDict(
            {
                k: torch.zeros((n, t1, *shape), dtype=dt, device=self.device)
                for k, (dt, shape) in self.schema.items()
            },
            batch_size=[n, t1],
            device=self.device,
        )
        self._state = _IDLE

    def __repr__(self) -> str:
        return (
            f"RolloutBuffer(num_envs={self.num_envs}, rollout_len={self.rollout_len}, "
            f"obs_dim={self.obs_dim}, action_dim={self.action_dim}, device={self.device}, "
            f"state={self._state!r})"
        )

    @property
    def state(self) -> str:
        """``"idle"`` (nothing to consume), ``"writing"`` (started) or ``"ready"`` (added)."""
        return self._state

    def start_rollout(self) -> TensorDict:
        """Return the shared ``[N, T+1]`` storage for a collector to write into.

        Drops algorithm fields attached to the previous rollout (they described other data)
        and zeroes ``final_value``. Raises if an added rollout was never consumed by ``get()``.
        """
        if self._state == _READY:
            raise RolloutBufferError(
                "RolloutBuffer.start_rollout(): the previous rollout was add()-ed but never "
                "consumed; call get() before starting a new rollout (it would be overwritten)"
            )
        for key in list(self._rollout.keys()):
            if key not in self.schema:
                del self._rollout[key]
        self._rollout["final_value"].zero_()
        self._state = _WRITING
        return self._rollout

    def write(self, t: int, **values: torch.Tensor) -> None:
        """Checked write of step ``t`` for each ``field=tensor`` given (tensor ``[N, *feature]``).

        Dtype and shape must match exactly (no silent casts); the tensor may live on another
        device (it is copied once). ``t == T`` is allowed only for ``obs`` and ``value``.
        """
        if self._state != _WRITING:
            raise RolloutBufferError(
                f"RolloutBuffer.write(t={t}): no rollout is being written (state "
                f"{self._state!r}); call start_rollout() first"
            )
        T = self.rollout_len
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= T:
            raise IndexError(f"RolloutBuffer.write: t must be an int in [0, {T}], got {t!r}")
        for name, value in values.items():
            if name not in self.schema:
                raise KeyError(
                    f"RolloutBuffer.write: unknown field {name!r}; known fields: "
                    f"{sorted(self.schema)} (attach algorithm fields on the rollout instead)"
                )
            if t == T and name not in STATE_FIELDS:
                raise IndexError(
                    f"RolloutBuffer.write: t={T} is the padding slot of transition-only field "
                    f"{name!r}; write it at t in [0, {T - 1}] (only obs/value have a slot {T})"
                )
            dtype, feat = self.schema[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"RolloutBuffer.write: field {name!r} must be a torch.Tensor, got "
                    f"{type(value).__name__}; convert with torch.as_tensor(..., dtype={dtype})"
                )
            want = (self.num_envs, *feat)
            if tuple(value.shape) != want:
                raise ValueError(
                    f"RolloutBuffer.write: field {name!r} at t={t} must have shape "
                    f"{list(want)} ([num_envs, *feature]), got {list(value.shape)}"
                )
            if value.dtype != dtype:
                raise TypeError(
                    f"RolloutBuffer.write: field {name!r} must have dtype {dtype}, got "
                    f"{value.dtype}; cast it (e.g. .to({dtype})) before writing"
                )
            self._rollout[name][:, t].copy_(value, non_blocking=True)

    def _check_schema(self, rollout: TensorDictBase) -> None:
        n, t1 = self.num_envs, self.rollout_len + 1
        for name, (dtype, feat) in self.schema.items():
            if name not in rollout:
                raise ValueError(f"RolloutBuffer.add: rollout is missing field {name!r}")
            x = rollout.get(name)
            want = (n, t1, *feat)
            if tuple(x.shape) != want or x.dtype != dtype or x.device != self.device:
                raise ValueError(
                    f"RolloutBuffer.add: field {name!r} must be {dtype} {list(want)} on "
                    f"{self.device}, got {x.dtype} {list(x.shape)} on {x.device}; write into "
                    "the preallocated tensors (buffer.write or rollout[key][:, t] = ...) "
                    "instead of replacing them"
                )

    def add(self, rollout: TensorDictBase) -> None:
        """Mark the shared rollout returned by ``start_rollout()`` as full and ready."""
        if self._state != _WRITING:
            what = "was already added" if self._state == _READY else "was never started"
            raise RolloutBufferError(
                f"RolloutBuffer.add(): the rollout {what}; call start_rollout(), write the "
                "steps, then add() once"
            )
        if rollout is not self._rollout:
            raise RolloutBufferError(
                "RolloutBuffer.add(): expected the TensorDict returned by start_rollout() "
                f"(shared storage), got another object with batch_size {list(rollout.batch_size)}"
            )
        self._check_schema(rollout)
        self._state = _READY

    def get(self, flatten: bool = True) -> TensorDict:
        """Consume the ready rollout; return its transition view (``[N*T]``, or ``[N, T]``)."""
        if self._state != _READY:
            why = (
                "start_rollout() was called but add() was not"
                if self._state == _WRITING
                else "no rollout was added since the last get() (rollouts are consumed once)"
            )
            raise RolloutBufferError(f"RolloutBuffer.get(): nothing to consume: {why}")
        self._state = _IDLE
        return transition_view(self._rollout, flatten=flatten)


def is_transition_view(td: TensorDictBase) -> bool:
    """True for TensorDicts built by ``transition_view`` (they carry ``next_value``)."""
    return NEXT_VALUE_KEY in td


def transition_view(rollout: TensorDictBase, flatten: bool = False) -> TensorDict:
    """Transition-aligned view of a ``[N, T+1]`` rollout: ``[N, T]``, or ``[N*T]`` if ``flatten``.

    Holds every rollout key sliced to the first ``T`` steps: ``obs[:, :T]`` (the observation
    each action was taken from), ``value[:, :T]``, the transition fields without their
    padding slot and any attached algorithm field; plus ``next_value = value[:, 1:]`` (so
    ``next_value[:, -1]`` is the bootstrap value). There is no ``next_obs``: after an
    autoreset ``obs[:, t+1]`` is the new episode's first observation, not the final one.
    Unflattened, the tensors alias the rollout (no copy). Passing a view again only
    flattens it, so ``transition_view(buffer.get(flatten=False), flatten=True)`` works.
    """
    if rollout.batch_dims not in (1, 2):
        raise ValueError(
            "transition_view: rollout must have batch shape [N, T+1] (or be a view), got "
            f"{list(rollout.batch_size)}"
        )
    if is_transition_view(rollout):
        return rollout.reshape(-1) if flatten and rollout.batch_dims == 2 else rollout  # type: ignore[return-value]
    if rollout.batch_dims != 2 or rollout.batch_size[1] < 2:
        raise ValueError(
            "transition_view: rollout must have batch shape [N, T+1] with T >= 1, got "
            f"{list(rollout.batch_size)}"
        )
    for key in STATE_FIELDS:
        if key not in rollout:
            raise KeyError(f"transition_view: rollout has no {key!r} field")
    n, t = rollout.batch_size[0], rollout.batch_size[1] - 1
    keys = list(rollout.keys())  # not `for key in rollout`: that walks the batch dim
    fields: dict[str, torch.Tensor | TensorDictBase] = {k: rollout.get(k)[:, :t] for k in keys}
    fields[NEXT_VALUE_KEY] = rollout.get("value")[:, 1:]
    view = TensorDict(fields, batch_size=[n, t], device=rollout.device)
    return view.reshape(-1) if flatten else view


def iterate_minibatches(
    rollout: TensorDictBase,
    batch_size: int,
    device: torch.device | str | None,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
) -> Iterator[TensorDict]:
    """Yield minibatches of ``batch_size`` transitions covering each one exactly once.

    ``rollout`` is a transition view (any batch shape, flattened here) or any flat
    TensorDict; a raw ``[N, T+1]`` rollout is refused since its padding slot would leak in.
    The last minibatch holds the remainder when ``batch_size`` does not divide the count.
    Order comes from ``torch.randperm(generator=generator)`` when ``shuffle``. Each batch
    is moved to ``device`` (``None``: stay where the data is).
    """
    if rollout.batch_dims != 1 and not is_transition_view(rollout):
        raise ValueError(
            f"iterate_minibatches: got a {list(rollout.batch_size)} TensorDict that is not a "
            "transition view; pass transition_view(rollout, flatten=True) so the padded "
            "final slot is dropped"
        )
    flat = rollout.reshape(-1) if rollout.batch_dims != 1 else rollout
    total = flat.batch_size[0]
    check_int("iterate_minibatches: batch_size", batch_size, 1)
    if batch_size > total:
        raise ValueError(
            f"iterate_minibatches: batch_size={batch_size} is larger than the data "
            f"({total} transitions); use batch_size <= {total}"
        )
    if shuffle:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        order = torch.randperm(total, generator=generator, device=gen_device).to(flat.device)
    else:
        order = torch.arange(total, device=flat.device)
    for start in range(0, total, batch_size):
        batch = flat[order[start : start + batch_size]]
        yield batch.to(device) if device is not None else batch
