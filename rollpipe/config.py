"""PipelineConfig: everything the standard chain needs, validated at construction.

Plain data (YAML or a dict, through ``from_dict``); a bad value fails here with a message
naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from rollpipe._utils.checks import (
    check_int,
    float_in,
    instance_of,
    int_at_least,
    one_of,
    optional,
)
from rollpipe.agent.chat import DEFAULT_SYSTEM_PROMPT
from rollpipe.agent.episode import DEFAULT_ENV_TIMEOUT_S, ON_LENGTH
from rollpipe.engines.records import SamplingParams
from rollpipe.envs import available as available_envs
from rollpipe.nodes.episode_source import EnvChoice, as_env_choices
from rollpipe.nodes.groups import GroupRule, check_group_rule

__all__ = ["PipelineConfig"]


def _sampling(value: SamplingParams | Mapping[str, Any]) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"PipelineConfig.sampling must be a SamplingParams or a dict of its fields "
            f"(e.g. {{'max_tokens': 48}}), got {value!r}"
        )
    valid = sorted(f.name for f in attrs.fields(SamplingParams))
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ValueError(f"PipelineConfig.sampling: unknown keys {unknown}; valid keys: {valid}")
    try:
        return SamplingParams(**value)
    except ValueError as exc:
        raise ValueError(f"PipelineConfig.sampling: {exc}") from exc


_ENVS_HINT = (
    "give an env name, an EnvChoice, or a list of them or of dicts "
    "{name: ..., config: {...}, weight: 1.0, tag: ...}"
)


def _envs(value: Any) -> tuple[EnvChoice, ...]:
    if isinstance(value, (str, EnvChoice)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"PipelineConfig.envs: got {value!r}; {_ENVS_HINT}")
    try:
        items = [_env_choice(v) for v in value]
        choices = as_env_choices(items)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"PipelineConfig.envs: {exc}; {_ENVS_HINT}") from exc
    known = available_envs()
    for c in choices:
        if c.name not in known:
            raise ValueError(f"PipelineConfig.envs: unknown env {c.name!r}; registered: {known}")
    return choices


def _env_choice(value: Any) -> EnvChoice | str:
    if isinstance(value, Mapping):
        if not isinstance(value.get("config", {}), Mapping):
            raise ValueError(f"an env's config must be a dict, got {value['config']!r}")
        return EnvChoice(**value)
    if not isinstance(value, (str, EnvChoice)):
        raise ValueError(f"an env must be a name, an EnvChoice or a dict, got {value!r}")
    return value


def _minus_one_is_none(value: Any) -> Any:
    """ROLL writes "no limit" as -1."""
    return None if isinstance(value, int) and not isinstance(value, bool) and value == -1 else value


_STR_OR_NONE: Any = optional(instance_of(str))
_SECONDS_OR_NONE: Any = optional(float_in(0.0, low_open=True))


def _count_or_none(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_int(f"PipelineConfig.{attr.name} (or None)", value, 0)


@attrs.frozen(kw_only=True)
class PipelineConfig:
    """Everything the standard chain needs. Bad values fail here, naming the field.

    ``envs`` takes an env name, an :class:`EnvChoice`, or a list mixing several by
    weight (YAML: ``[{name: sokoban, weight: 1, config: {dim_room: [6, 6]}}]``).
    ``batch_size`` counts trajectories and must be a multiple of ``group_size``.
    ``num_groups=None`` runs forever. ``in_order=None`` (auto) yields trajectories in
    admission order — reproducible — unless ``redundancy`` or ``max_traj_per_env`` is
    set, where completion order lets the first finishers win.

    ``async_generation_ratio`` (ROLL's name and default, 0) bounds how far generation
    runs ahead of the trainer: each ``get_batch`` lets the source start that batch's
    groups, plus ``ratio`` batches' worth ahead once at the start, and a group whose
    oldest token is more than ``ratio`` policy versions old is dropped (and replaced).
    0 is on-policy: a batch holds only tokens of the current weights. ``None`` lets
    collection run ahead freely (up to the rollout's buffer), with no staleness bound.

    ``max_traj_per_env`` (ROLL's name; ``None`` or ROLL's ``-1``: just one batch) sets
    how many trajectories each step starts per env slot, rollpipe's env slots being its
    ``concurrency`` parallel episodes (ROLL's ``num_env_groups * group_size`` envs):
    each ``get_batch`` then grants ``ceil(max_traj_per_env * concurrency / group_size)``
    groups, at least one batch. The first to finish fill the batch (completion order
    unless ``in_order`` says otherwise); a granted group not started within
    ``async_generation_ratio`` steps expires (``dropped/expired``), as in ROLL.

    ``env_backend="ray"`` runs each env slot's env in a Ray actor (for heavy envs or
    isolation: a crashed worker fails only its episode and is replaced; see
    ``rollpipe.envs.ray_env``); ``"local"`` (default) runs them in this process.

    ``env_timeout_s`` limits each env ``reset`` / ``step`` call (default 60 s; None: no
    limit): a call over it ends its episode as errored (the group is handled like any
    errored group) while every other episode and the engine go on. Envs run on env
    threads (``env_workers``; 0: one per episode in flight), off the event loop, unless
    the env declares ``blocking = False`` (the built-in grid envs), which runs inline.
    ``generation_timeout_s`` (default None: no limit) limits each
    engine request the same way: over it, the request is aborted and its episode errored.
    Time the engine spends paused (``suspend``) does not count.

    ``reward_clip`` (default None): a reward that is not finite in float32 fails its
    episode (errored). Set to ``c > 0``, a reward beyond ``±c`` (±inf included) is
    clipped to ``±c`` and counted in the batch metric ``rewards_clipped``; NaN, which
    has no side to clip to, still fails the episode.

    ``layout``: ``"native"`` rows (``rollpipe.data.rows``), ``"roll"`` (ROLL's agentic
    field names, dtypes and placement: ``DataProto.to_roll()``) or ``"verl"`` (a real
    ``verl.protocol.DataProto`` in verl's agent-loop layout: ``to_verl()``, needs verl).
    """

    envs: tuple[EnvChoice, ...] = attrs.field(default=("frozenlake",), converter=_envs)
    group_size: int = attrs.field(default=4, validator=int_at_least(1))
    batch_size: int = attrs.field(default=16, validator=int_at_least(1))
    num_groups: int | None = attrs.field(default=None, validator=optional(int_at_least(1)))
    redundancy: int = attrs.field(default=0, validator=int_at_least(0))
    seed: int = attrs.field(default=0, validator=int_at_least(0))
    max_turns: int = attrs.field(default=5, validator=int_at_least(1))
    max_length: int = attrs.field(default=1024, validator=int_at_least(1))
    concurrency: int = attrs.field(default=32, validator=int_at_least(1))
    env_workers: int = attrs.field(default=0, validator=int_at_least(0))
    env_timeout_s: float | None = attrs.field(
        default=DEFAULT_ENV_TIMEOUT_S, validator=_SECONDS_OR_NONE
    )
    generation_timeout_s: float | None = attrs.field(default=None, validator=_SECONDS_OR_NONE)
    reward_clip: float | None = attrs.field(
        default=None, validator=optional(float_in(0.0, low_open=True))
    )
    env_backend: Literal["local", "ray"] = attrs.field(
        default="local", validator=one_of("local", "ray")
    )
    sampling: SamplingParams = attrs.field(
        factory=lambda: SamplingParams(max_tokens=48), converter=_sampling
    )
    system_prompt: str | None = attrs.field(default=DEFAULT_SYSTEM_PROMPT, validator=_STR_OR_NONE)
    history_window: int | None = attrs.field(default=None, validator=optional(int_at_least(0)))
    layout: Literal["native", "roll", "verl"] = attrs.field(
        default="native", validator=one_of("native", "roll", "verl")
    )
    level: Literal["trajectory", "step"] = attrs.field(
        default="trajectory", validator=one_of("trajectory", "step")
    )
    pad_to_multiple_of: int | None = attrs.field(default=None, validator=optional(int_at_least(1)))
    keep_group: str | GroupRule | None = attrs.field(default=None, validator=check_group_rule)
    drop_group: str | GroupRule | None = attrs.field(default=None, validator=check_group_rule)
    async_generation_ratio: int | None = attrs.field(default=0, validator=_count_or_none)
    max_traj_per_env: int | None = attrs.field(
        default=None, converter=_minus_one_is_none, validator=optional(int_at_least(1))
    )
    max_drops_in_a_row: int = attrs.field(default=1000, validator=int_at_least(1))
    in_order: bool | None = attrs.field(default=None, validator=optional(instance_of(bool)))
    raise_env_errors: bool = attrs.field(default=False, validator=instance_of(bool))
    on_length: Literal["step", "skip", "end"] = attrs.field(
        default="step", validator=one_of(*ON_LENGTH)
    )
    length_penalty: float | None = attrs.field(
        default=None, validator=optional(float_in(-math.inf))
    )

    def __attrs_post_init__(self) -> None:
        if self.on_length == "step" and self.length_penalty is not None:
            raise ValueError(
                "PipelineConfig.length_penalty applies only to on_length='skip' or 'end'; "
                "with 'step' the env alone rewards a cut response"
            )
        if self.batch_size % self.group_size:
            raise ValueError(
                f"PipelineConfig.batch_size={self.batch_size} is not a multiple of "
                f"group_size={self.group_size}; batches hold whole groups"
            )
        if self.max_traj_per_env is not None:
            if self.async_generation_ratio is None:
                raise ValueError(
                    "PipelineConfig.max_traj_per_env needs async_generation_ratio (an int): "
                    "with None collection is not metered per step"
                )
            if self.max_traj_per_env * self.concurrency < self.batch_size:
                raise ValueError(
                    f"PipelineConfig.max_traj_per_env={self.max_traj_per_env} x "
                    f"concurrency={self.concurrency} starts fewer trajectories per step "
                    f"than batch_size={self.batch_size}; raise max_traj_per_env to at least "
                    f"{math.ceil(self.batch_size / self.concurrency)} (or -1: one batch)"
                )
        if self.level == "step" and self.history_window is None:
            raise ValueError(
                "PipelineConfig.level='step' needs history_window (e.g. 2): step rows "
                "show a bounded window of recent turns"
            )

    @property
    def groups_per_step(self) -> int:
        """Groups each ``get_batch`` lets the source start (see ``max_traj_per_env``)."""
        per_batch = self.batch_size // self.group_size
        if self.max_traj_per_env is None:
            return per_batch
        return max(per_batch, math.ceil(self.max_traj_per_env * self.concurrency / self.group_size))

    @property
    def admission_order(self) -> bool:
        """``in_order`` resolved: admission order unless first finishers should win
        (``redundancy`` or ``max_traj_per_env`` start more than a batch needs)."""
        if self.in_order is not None:
            return self.in_order
        return self.redundancy == 0 and self.max_traj_per_env is None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineConfig:
        """From plain data (YAML); an unknown key is an error listing the valid ones."""
        if "filter" in data:
            raise ValueError(
                "PipelineConfig.filter was renamed: filter='zero_variance' is now "
                "drop_group='zero_variance' (True drops, as ROLL's filter()); a predicate "
                "that returns True to keep a group goes to keep_group"
            )
        valid = sorted(f.name for f in attrs.fields(cls))
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(f"PipelineConfig: unknown keys {unknown}; valid keys: {valid}")
        return cls(**data)

    def replace(self, **changes: Any) -> PipelineConfig:
        return attrs.evolve(self, **changes)
