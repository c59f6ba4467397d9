"""PipelineConfig: the standard chain's settings, one record per stage plus what is
pipeline-wide.

Each stage's settings are a frozen record defined and checked in that stage's module:
``source`` (:class:`SourceSettings`, ``nodes/episode_source.py``), ``episode``
(:class:`EpisodeSettings`, ``agent/episode.py``), ``rollout`` (:class:`RunnerSettings`,
``nodes/rollout.py``), ``groups`` (:class:`GroupSettings`, ``nodes/groups.py``) and
``collate`` (:class:`CollateSettings`, ``nodes/collate.py``). ``PipelineConfig`` adds
``batch_size``, ``async_generation_ratio``, ``max_off_policy_strategy`` and
``max_traj_per_env`` and checks only what spans sections. Flat names
(``PipelineConfig(group_size=4, max_turns=3)``, ROLL style) keep working: each is routed
to its section by a table built from the records' fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from rollpipe._utils.checks import check_int, int_in, optional
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.nodes.collate import CollateSettings
from rollpipe.nodes.episode_source import SourceSettings
from rollpipe.nodes.groups import GroupSettings
from rollpipe.nodes.rollout import RolloutSettings, RunnerSettings

__all__ = [
    "FLAT_NAMES",
    "SECTIONS",
    "CollateSettings",
    "EpisodeSettings",
    "GroupSettings",
    "PipelineConfig",
    "RolloutSettings",  # old name of RunnerSettings, kept importable
    "RunnerSettings",
    "SourceSettings",
]

SECTIONS: dict[str, type] = {
    "source": SourceSettings,
    "episode": EpisodeSettings,
    "rollout": RunnerSettings,
    "groups": GroupSettings,
    "collate": CollateSettings,
}
"""Section name -> its record class (each defined beside its stage)."""
WIDE = ("batch_size", "async_generation_ratio", "max_off_policy_strategy", "max_traj_per_env")
"""The pipeline-wide fields (no section)."""
FLAT_NAMES: dict[str, str] = {
    f.name: section for section, cls in SECTIONS.items() for f in attrs.fields(cls)
}
"""Flat name -> its section, from the records' fields: ``max_turns`` -> ``"episode"``."""
assert len(FLAT_NAMES) == sum(len(attrs.fields(c)) for c in SECTIONS.values()), "names clash"
assert not set(FLAT_NAMES) & {*SECTIONS, *WIDE}, "a flat name clashes with a section"

RENAMED = {
    "filter": "PipelineConfig.filter was renamed: filter='zero_variance' is now "
    "drop_group='zero_variance' (True drops, as ROLL's filter()); a predicate that returns "
    "True to keep a group goes to keep_group",
    "max_staleness": "PipelineConfig.max_staleness was renamed to async_generation_ratio "
    "(ROLL's name: how many policy versions a group may lag; 0 is on-policy)",
}
MAX_BATCH_SIZE = 2**20
MAX_RATIO = 1024
MAX_TRAJ_PER_ENV = 65536
STALENESS_STRATEGIES = ("drop", "wait")
"""``max_off_policy_strategy`` values (verl's): drop stale groups, or never let them go stale."""


def _minus_one_is_none(value: Any) -> Any:
    """ROLL writes "no limit" as -1."""
    return None if isinstance(value, int) and not isinstance(value, bool) and value == -1 else value


def _ratio(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_int(f"PipelineConfig.{attr.name} (or None)", value, 0, MAX_RATIO)


def _strategy(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or value not in STALENESS_STRATEGIES:
        raise ValueError(
            f"PipelineConfig.{attr.name}={value!r}: use 'drop' (a finished group older than "
            "async_generation_ratio versions is dropped and replaced, ROLL's behaviour) or "
            "'wait' (the trainer waits for the groups about to go stale; none is dropped)"
        )


def _article(word: str) -> str:
    return "an" if word[0] in "AEIOU" else "a"


def _valid_keys() -> list[str]:
    return [*SECTIONS, *WIDE, *sorted(FLAT_NAMES)]


def _section(name: str, given: Any, flat: dict[str, Any]) -> Any:
    """Section ``name`` from what was given for it (a record, a mapping or nothing) with
    the flat keys routed to it on top (a flat key wins over the same key in the section)."""
    cls = SECTIONS[name]
    if given is None or isinstance(given, cls):
        record: Any = cls() if given is None else given
        return attrs.evolve(record, **flat) if flat else record
    if not isinstance(given, Mapping):
        raise ValueError(
            f"PipelineConfig.{name} must be {_article(cls.__name__)} {cls.__name__} or a "
            "mapping of its fields, "
            f"got {type(given).__name__} {given!r:.200}"
        )
    valid = [f.name for f in attrs.fields(cls)]
    unknown = sorted(map(str, set(given) - set(valid)))
    if unknown:
        raise ValueError(
            f"PipelineConfig.{name}: unknown keys {unknown}; valid keys: {sorted(valid)}"
        )
    return cls(**{**given, **flat})


def _routed(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``__attrs_init__``: every section built (flat keys routed to
    theirs), the pipeline-wide fields as given; an unknown key lists the valid ones."""
    for old, hint in RENAMED.items():
        if old in settings:
            raise ValueError(hint)
    unknown = sorted(map(str, set(settings) - set(SECTIONS) - set(WIDE) - set(FLAT_NAMES)))
    if unknown:
        raise ValueError(
            f"PipelineConfig: unknown keys {unknown}; valid keys: sections {list(SECTIONS)}, "
            f"pipeline-wide {list(WIDE)} and the sections' fields {sorted(FLAT_NAMES)}"
        )
    flat: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in settings.items():
        if key in FLAT_NAMES:
            flat[FLAT_NAMES[key]][key] = value
    out = {k: settings[k] for k in WIDE if k in settings}
    for name in SECTIONS:
        out[name] = _section(name, settings.get(name), flat[name])
    return out


@attrs.frozen(kw_only=True, init=False)
class PipelineConfig:
    """Everything the standard chain needs: one settings record per stage, plus what is
    pipeline-wide. Bad values fail here, naming the field, the value and the range.

    Build it with sections, flat names, or both:

    >>> PipelineConfig(episode={"max_turns": 3}).episode.max_turns
    3
    >>> cfg = PipelineConfig(group_size=2, batch_size=4, max_turns=3)  # ROLL-style flat names
    >>> cfg.source.group_size, cfg.episode.max_turns, cfg.max_turns
    (2, 3, 3)

    A section takes its record or a mapping of its fields (missing fields: defaults);
    a flat name given together with its section is applied on top of it (the flat name
    wins). Reading a flat name (``config.group_size``) reads it from its section.

    Sections (see each record for its fields): ``source`` (envs, group_size,
    num_groups, redundancy, seed), ``episode`` (max_turns, max_length, sampling,
    system_prompt, history_window, env_timeout_s, generation_timeout_s, reward_clip,
    raise_env_errors, on_length, length_penalty, max_aborts), ``rollout`` (concurrency,
    env_workers, env_backend, in_order), ``groups`` (keep_group, drop_group,
    max_drops_in_a_row, max_errors_in_a_row, max_error_seconds), ``collate`` (level,
    pad_to_multiple_of, layout).

    ``batch_size`` counts trajectories and must be a multiple of ``group_size``.

    ``async_generation_ratio`` (ROLL's name and default, 0) bounds how far generation
    runs ahead of the trainer: each ``get_batch`` lets the source start that batch's
    groups, plus ``ratio`` batches' worth ahead once at the start, and a group whose
    oldest token is more than ``ratio`` policy versions old is dropped (and replaced).
    0 is on-policy: a batch holds only tokens of the weights current when it is returned
    (groups made stale by an update while they waited in the Batch stage, from another
    thread, are dropped and replaced: ``dropped/stale``; docs/pausing.md). ``None`` lets
    collection run ahead freely (up to the rollout's buffer), with no staleness bound.

    ``max_off_policy_strategy`` (verl's name; ``"drop"``, the default, or ``"wait"``) is
    what happens to a group about to exceed that bound. ``"drop"``: batches fill with the
    first groups to finish and a finished group that is too old is dropped and replaced
    (ROLL's behaviour). ``"wait"``: a batch takes the oldest live groups by the version
    they started at, waiting for those still running (the first to finish among those
    of one version), so with one update per batch no group is ever stale or dropped for
    it; grants never expire. It
    needs an int ``async_generation_ratio`` and no ``max_traj_per_env`` (docs/off-policy.md).

    ``max_traj_per_env`` (ROLL's name; ``None`` or ROLL's ``-1``: just one batch) sets
    how many trajectories each step starts per env slot, rollpipe's env slots being its
    ``concurrency`` parallel episodes (ROLL's ``num_env_groups * group_size`` envs):
    each ``get_batch`` then grants ``ceil(max_traj_per_env * concurrency / group_size)``
    groups, at least one batch. The first to finish fill the batch (completion order
    unless ``in_order`` says otherwise); a granted group not started within
    ``async_generation_ratio`` steps expires (``dropped/expired``), as in ROLL.
    ``in_order=None`` (auto) yields trajectories in admission order — reproducible —
    unless ``redundancy`` or ``max_traj_per_env`` is set (see ``admission_order``).
    """

    source: SourceSettings = attrs.field(factory=SourceSettings)
    episode: EpisodeSettings = attrs.field(factory=EpisodeSettings)
    rollout: RunnerSettings = attrs.field(factory=RunnerSettings)
    groups: GroupSettings = attrs.field(factory=GroupSettings)
    collate: CollateSettings = attrs.field(factory=CollateSettings)
    batch_size: int = attrs.field(default=16, validator=int_in(1, MAX_BATCH_SIZE))
    async_generation_ratio: int | None = attrs.field(default=0, validator=_ratio)
    max_off_policy_strategy: str = attrs.field(default="drop", validator=_strategy)
    max_traj_per_env: int | None = attrs.field(
        default=None,
        converter=_minus_one_is_none,
        validator=optional(int_in(1, MAX_TRAJ_PER_ENV)),
    )

    def __init__(self, **settings: Any) -> None:
        self.__attrs_init__(**_routed(settings))  # type: ignore[attr-defined]

    def __attrs_post_init__(self) -> None:
        source, episode, collate = self.source, self.episode, self.collate
        if self.batch_size % source.group_size:
            raise ValueError(
                f"PipelineConfig.batch_size={self.batch_size} is not a multiple of "
                f"group_size={source.group_size}; batches hold whole groups"
            )
        if self.max_traj_per_env is not None:
            if self.async_generation_ratio is None:
                raise ValueError(
                    "PipelineConfig.max_traj_per_env needs async_generation_ratio (an int): "
                    "with None collection is not metered per step"
                )
            concurrency = self.rollout.concurrency
            if self.max_traj_per_env * concurrency < self.batch_size:
                raise ValueError(
                    f"PipelineConfig.max_traj_per_env={self.max_traj_per_env} x "
                    f"concurrency={concurrency} starts fewer trajectories per step "
                    f"than batch_size={self.batch_size}; raise max_traj_per_env to at least "
                    f"{math.ceil(self.batch_size / concurrency)} (or -1: one batch)"
                )
        if self.max_off_policy_strategy == "wait":
            if self.async_generation_ratio is None:
                raise ValueError(
                    "PipelineConfig.max_off_policy_strategy='wait' needs async_generation_ratio "
                    "(an int: the bound to wait for); with None nothing is ever stale"
                )
            if self.max_traj_per_env is not None:
                raise ValueError(
                    f"PipelineConfig.max_off_policy_strategy='wait' with max_traj_per_env="
                    f"{self.max_traj_per_env}: 'wait' admits one batch of groups per step (AReaL's "
                    "bound), more would go stale; leave max_traj_per_env unset or use 'drop'"
                )
        if collate.level == "step" and episode.history_window is None:
            raise ValueError(
                "PipelineConfig.level='step' needs history_window (e.g. 2): step rows "
                "show a bounded window of recent turns"
            )
        if collate.level == "trajectory" and episode.history_window is not None:
            raise ValueError(
                f"PipelineConfig.history_window={episode.history_window} needs level='step': "
                "with a window each turn sees its own prompt, so a trajectory has no single "
                "token-exact row; set level='step' (a row per turn) or history_window=None"
            )

    def __getattr__(self, name: str) -> Any:
        """A flat name (``config.group_size``) reads its section's field."""
        section = FLAT_NAMES.get(name)
        if section is None or name.startswith("_"):
            raise AttributeError(f"PipelineConfig has no field {name!r}; valid: {_valid_keys()}")
        return getattr(getattr(self, section), name)

    @property
    def groups_per_step(self) -> int:
        """Groups each ``get_batch`` lets the source start (see ``max_traj_per_env``)."""
        per_batch = self.batch_size // self.source.group_size
        if self.max_traj_per_env is None:
            return per_batch
        started = self.max_traj_per_env * self.rollout.concurrency
        return max(per_batch, math.ceil(started / self.source.group_size))

    @property
    def admission_order(self) -> bool:
        """``in_order`` resolved: admission order unless first finishers should win
        (``redundancy`` or ``max_traj_per_env`` start more than a batch needs)."""
        if self.rollout.in_order is not None:
            return self.rollout.in_order
        return self.source.redundancy == 0 and self.max_traj_per_env is None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineConfig:
        """From plain data (YAML): sections as nested mappings, or ROLL-style flat names,
        or both (a flat name wins over its section's). An unknown key is an error listing
        the valid ones.

        >>> PipelineConfig.from_dict({"source": {"group_size": 2}, "batch_size": 4}).group_size
        2
        """
        if not isinstance(data, Mapping):
            raise ValueError(
                "PipelineConfig.from_dict needs a mapping of fields (YAML: 'key: value' "
                f"lines or sections), got {type(data).__name__} {data!r:.200}"
            )
        keys = [k for k in data if not isinstance(k, str)]
        if keys:
            raise ValueError(f"PipelineConfig.from_dict: keys must be str, got {keys[:5]!r}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Sections as dicts of their fields, and the pipeline-wide fields (the reverse
        of ``from_dict`` for plain values; ``sampling`` and ``envs`` stay records)."""
        out: dict[str, Any] = {n: attrs.asdict(getattr(self, n), recurse=False) for n in SECTIONS}
        return {**out, **{k: getattr(self, k) for k in WIDE}}

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with ``changes``: flat names, pipeline-wide fields or sections. A
        section given as a record replaces it; as a mapping, it updates the fields named.

        >>> PipelineConfig().replace(max_turns=2, rollout={"concurrency": 8}).concurrency
        8
        """
        current = self.to_dict()
        for name in SECTIONS:
            given = changes.get(name)
            if isinstance(given, Mapping):
                changes = {**changes, name: {**current[name], **given}}
        return PipelineConfig(**{**current, **changes})
