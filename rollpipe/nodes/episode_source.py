"""EpisodeSource: the stream of episode specs that starts every rollout.

All members of a group share one seed (so they start from the same state, as GRPO
needs) and every seed derives from the one user seed, so the same config yields the
same episodes in every run. Its state is a counter (group, member) plus the metered
budget (``budget``, ``grants``, ``step``, ``expired_groups``). With a dataset
(``rollpipe.nodes.dataset``) each group is one row, in an order the seed fixes, so the
same counter is also the position in the pass.

:class:`SourceSettings` holds its settings (``PipelineConfig.source``), checked once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
from torchdata.nodes import BaseNode

from rollpipe._utils.checks import check_fields, check_int, float_in, int_at_least, int_in, optional
from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.records import EpisodeSpec
from rollpipe.envs.registry import check_env
from rollpipe.nodes.dataset import DatasetSettings, RowOrder
from rollpipe.nodes.signals import PipelineSignals

MAX_GROUP_SIZE = 65536
MAX_REDUNDANCY = 1024
"""Extra members per group: each is run, then cancelled once ``group_size`` finished."""
MAX_SEED = 2**63 - 1


@attrs.frozen
class EnvChoice:
    """One kind of environment in a mix: registry name, config, mixing weight and tag.

    Examples:
        >>> mix = [EnvChoice("frozenlake", {"size": 3}, weight=3), EnvChoice("sokoban", tag="box")]
        >>> [choice.label for choice in mix]
        ['frozenlake', 'box']
        >>> [spec.tag for spec in EpisodeSource(num_groups=6, group_size=1, envs=mix)]  # seeded
        ['frozenlake', 'frozenlake', 'box', 'frozenlake', 'box', 'frozenlake']
    """

    name: str
    config: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    weight: float = attrs.field(default=1.0, validator=float_in(0.0))
    tag: str = ""

    @property
    def label(self) -> str:
        """The tag rows carry: the explicit tag, else the env name."""
        return self.tag or self.name


def as_env_choices(envs: str | EnvChoice | Sequence[str | EnvChoice]) -> tuple[EnvChoice, ...]:
    """Normalise ``"frozenlake"``, an EnvChoice, or a list of either."""
    items = [envs] if isinstance(envs, (str, EnvChoice)) else list(envs)
    if not items:
        raise ValueError("envs: need at least one environment, got an empty list")
    choices = tuple(EnvChoice(e) if isinstance(e, str) else e for e in items)
    if sum(c.weight for c in choices) <= 0:
        raise ValueError(f"envs: weights must not all be 0, got {[c.weight for c in choices]}")
    return choices


_ENVS_HINT = (
    "give an env name (registered, or an import path 'package.module:Factory'), an "
    "EnvChoice, or a list of them or of dicts {name: ..., config: {...}, weight: 1.0, tag: ...}"
)


def _env_choice(value: Any) -> EnvChoice | str:
    if isinstance(value, Mapping):
        if not isinstance(value.get("config", {}), Mapping):
            raise ValueError(f"an env's config must be a dict, got {value['config']!r}")
        return EnvChoice(**value)
    if not isinstance(value, (str, EnvChoice)):
        raise ValueError(f"an env must be a name, an EnvChoice or a dict, got {value!r}")
    return value


def _envs(value: Any) -> tuple[EnvChoice, ...]:
    if isinstance(value, (str, EnvChoice)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"SourceSettings.envs: got {value!r}; {_ENVS_HINT}")
    try:
        return as_env_choices([_env_choice(v) for v in value])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"SourceSettings.envs: {exc}; {_ENVS_HINT}") from exc


def _dataset(value: Any) -> DatasetSettings | None:
    if value is None or isinstance(value, DatasetSettings):
        return value
    try:
        if isinstance(value, Mapping):
            return DatasetSettings(**value)
        return DatasetSettings(rows=value)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"SourceSettings.dataset: {exc} (a DatasetSettings, its rows, or a dict "
            "{rows: ..., shuffle: true, epochs: 1})"
        ) from exc


@attrs.frozen(kw_only=True)
class SourceSettings:
    """What the :class:`EpisodeSource` yields (``PipelineConfig.source``), checked here once.

    ``envs``: an env name, an :class:`EnvChoice`, or a list mixing several by weight
    (YAML: ``[{name: sokoban, weight: 1, config: {dim_room: [6, 6]}}]``); a name is a
    registered one or an import path ``"package.module:Factory"`` (resolvable in any
    process, a Ray actor included). Each resolves and one env is built with its config
    at construction, so a typo or a bad value of the env's own fails here.
    ``group_size``: trajectories per group (GRPO's ``n``, at most ``MAX_GROUP_SIZE``).
    ``num_groups``: groups to run (None: endless). ``redundancy``: extra members started
    per group (at most ``MAX_REDUNDANCY``); the first ``group_size`` to finish win.
    ``seed``: the one seed every episode derives from. ``dataset``: draw each group's
    row from a :class:`~rollpipe.nodes.dataset.DatasetSettings` (or its rows, or a dict
    of its fields); the env's ``reset(seed, row=...)`` receives the row.

    Examples:
        >>> settings = SourceSettings(envs=[{"name": "frozenlake", "config": {"size": 3}}],
        ...                           group_size=2, num_groups=8)
        >>> settings.envs[0].config, settings.group_size, settings.redundancy
        ({'size': 3}, 2, 0)
        >>> SourceSettings(envs="frozenlak")
        Traceback (most recent call last):
        ...
        ValueError: SourceSettings.envs: ...
    """

    envs: tuple[EnvChoice, ...] = attrs.field(default=("frozenlake",), converter=_envs)
    group_size: int = attrs.field(default=4, validator=int_in(1, MAX_GROUP_SIZE))
    num_groups: int | None = attrs.field(default=None, validator=optional(int_at_least(1)))
    redundancy: int = attrs.field(default=0, validator=int_in(0, MAX_REDUNDANCY))
    seed: int = attrs.field(default=0, validator=int_in(0, MAX_SEED))
    dataset: DatasetSettings | None = attrs.field(default=None, converter=_dataset)

    def __attrs_post_init__(self) -> None:
        """Each env resolves and accepts its config (one is built and closed now), and
        takes rows when there is a dataset."""
        for choice in self.envs:
            try:
                check_env(choice.name, dict(choice.config), row=self.dataset is not None)
            except ValueError as exc:
                raise ValueError(f"SourceSettings.envs: {exc}") from exc


class EpisodeSource(BaseNode[EpisodeSpec]):
    """Yields ``members_per_group`` specs per group for ``num_groups`` groups (None: endless).

    Args:
        num_groups: groups to produce; ``None`` never ends.
        group_size: trajectories a group needs (GRPO's ``n``).
        seed: the user seed every episode seed derives from.
        envs: an env name, an :class:`EnvChoice`, or several mixed by ``weight`` (one
            draw per group, so all members of a group run the same env).
        redundancy: extra members started per group; the first ``group_size`` to finish win.
        signals: when given, groups requested by downstream stages (replacements for
            dropped groups, or the pipeline's grants) are added to the budget.
        metered: start with a budget of 0 groups and issue only what is granted through
            ``signals.grant_groups`` (never more than ``num_groups``): the pipeline
            grants one batch's groups per ``get_batch``, so generation does not run
            ahead of the trainer (on-policy; see ``async_generation_ratio``).
        expire_after: metered only: a granted group not yet started when a grant of a
            step more than this many steps newer arrives is never started (counted in
            ``expired_groups``), as ROLL's GroupQueue expires groups at ``advance_step``.
        current_version: when given (``max_off_policy_strategy="wait"``), each group's
            start version is recorded in ``signals`` (``note_started``), so that the
            Batch can take the oldest groups first, waiting for them, instead of
            dropping the ones that go stale.
        dataset: draw group ``g``'s row from it (see ``rollpipe.nodes.dataset``); the
            source ends after its epochs, or after ``num_groups`` if that comes first.

    Examples:
        >>> specs = list(EpisodeSource(num_groups=2, group_size=2, seed=7))
        >>> [(spec.group_id, spec.episode_id) for spec in specs]
        [(0, 0), (0, 1), (1, 2), (1, 3)]
        >>> specs[0].seed == specs[1].seed != specs[2].seed  # a group's members share it
        True
        >>> signals = PipelineSignals()
        >>> metered = EpisodeSource(None, 2, signals=signals, metered=True)
        >>> signals.grant_groups(1)
        >>> [spec.episode_id for spec in metered]  # the granted group, then no more
        [0, 1]
    """

    def __init__(
        self,
        num_groups: int | None,
        group_size: int,
        seed: int = 0,
        envs: str | EnvChoice | Sequence[str | EnvChoice] = "frozenlake",
        *,
        redundancy: int = 0,
        signals: PipelineSignals | None = None,
        metered: bool = False,
        expire_after: int | None = None,
        dataset: DatasetSettings | None = None,
        current_version: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        if num_groups is not None:  # 0 is an empty source here; a pipeline needs >= 1
            check_int("EpisodeSource.num_groups (or None: endless)", num_groups, 0)
        check_fields(  # SourceSettings' checks, the one place these rules live
            "EpisodeSource", SourceSettings, group_size=group_size, redundancy=redundancy, seed=seed
        )
        self.num_groups = num_groups
        self.group_size = group_size
        self.redundancy = redundancy
        self.seed = seed
        self.envs = as_env_choices(envs)
        self.signals = signals
        if metered and signals is None:
            raise ValueError("EpisodeSource: metered=True needs signals to receive grants")
        self.metered = metered
        if expire_after is not None:
            check_int("EpisodeSource.expire_after (or None)", expire_after, 0)
        self.expire_after = expire_after
        if current_version is not None and signals is None:
            raise ValueError("EpisodeSource: current_version needs signals to record starts")
        self.current_version = current_version
        self.dataset = dataset
        self._rows = None if dataset is None else RowOrder(dataset, seed)
        self._row: tuple[int, tuple[int, Any] | None] | None = None  # (group, its row)
        weights = np.array([c.weight for c in self.envs], dtype=np.float64)
        self._cum_weights = np.cumsum(weights / weights.sum())
        self._group = 0
        self._member = 0
        self._budget = num_groups  # groups it may issue in all (None: endless)
        self._grants: list[list[int]] = []  # metered: [groups not started, step] in order
        self._step = 0  # metered: the newest step a grant came with
        self.expired_groups = 0  # metered: granted groups that expired unstarted

    @classmethod
    def from_settings(
        cls,
        settings: SourceSettings,
        *,
        signals: PipelineSignals | None = None,
        metered: bool = False,
        expire_after: int | None = None,
        current_version: Callable[[], int] | None = None,
    ) -> EpisodeSource:
        """The source ``settings`` describe, with the pipeline's wiring."""
        s = settings
        return cls(
            s.num_groups,
            s.group_size,
            s.seed,
            s.envs,
            redundancy=s.redundancy,
            signals=signals,
            metered=metered,
            expire_after=expire_after,
            dataset=s.dataset,
            current_version=current_version,
        )

    @property
    def members_per_group(self) -> int:
        return self.group_size + self.redundancy

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._group, self._member, self._budget = 0, 0, self.num_groups
            self._grants, self._step, self.expired_groups = [], 0, 0
        else:
            self._group = int(initial_state["group"])
            self._member = int(initial_state["member"])
            self._budget = initial_state["budget"]
            self._grants = [[int(n), int(s)] for n, s in initial_state["grants"]]
            self._step = int(initial_state["step"])
            self.expired_groups = int(initial_state["expired_groups"])

    def get_state(self) -> dict[str, Any]:
        return {
            "group": self._group,
            "member": self._member,
            "budget": self._budget,
            "grants": [list(g) for g in self._grants],
            "step": self._step,
            "expired_groups": self.expired_groups,
        }

    def expired(self) -> int:
        """Granted groups that expired unstarted so far (metered, with ``expire_after``);
        ``RolloutPipeline`` reports the increase per batch as ``dropped/expired``."""
        return self.expired_groups

    def choice_for(self, group_id: int) -> EnvChoice:
        """The env kind of ``group_id``: a seeded weighted draw, fixed per group."""
        if len(self.envs) == 1:
            return self.envs[0]
        u = np.random.default_rng(derive_seed(self.seed, group_id, 1)).random()
        return self.envs[int(np.searchsorted(self._cum_weights, u, side="right"))]

    def row_of(self, group_id: int) -> tuple[int, Any] | None:
        """``(row index, row)`` of ``group_id`` (None: no dataset, or its epochs are done)."""
        if self._rows is None:
            return None
        if self._row is None or self._row[0] != group_id:
            self._row = (group_id, self._rows.row(group_id))
        return self._row[1]

    def spec(self, group_id: int, member: int) -> EpisodeSpec:
        """The spec of member ``member`` of group ``group_id`` (pure function of the config)."""
        env = self.choice_for(group_id)
        index, row = self.row_of(group_id) or (None, None)
        return EpisodeSpec(
            group_id=group_id,
            episode_id=group_id * self.members_per_group + member,
            seed=derive_seed(self.seed, group_id),
            env_name=env.name,
            env_config=env.config,  # frozen (hashable, sorted) by EpisodeSpec
            tag=env.label,
            row=row,
            row_index=index,
        )

    def _take_requests(self, signals: PipelineSignals) -> None:
        """Add downstream requests to the budget: replacements, and (metered) grants,
        expiring grants too old for ``expire_after``."""
        replacements = signals.take_replacements()
        if self._budget is not None:
            self._budget += replacements
        if not self.metered:
            return
        for n, step in signals.take_grants():
            self._grants.append([n, step])
            self._step = max(self._step, step)
        if replacements:  # ROLL creates a replacement at the current step
            self._grants.append([replacements, self._step])
        if self.expire_after is not None:
            fresh = [g for g in self._grants if self._step - g[1] <= self.expire_after]
            self.expired_groups += sum(g[0] for g in self._grants) - sum(g[0] for g in fresh)
            self._grants = fresh

    def _start_group(self) -> bool:
        """Whether a new group may start now; a metered source uses up one granted group."""
        if self._budget is not None and self._group >= self._budget:
            return False
        if self._rows is not None and self.row_of(self._group) is None:
            return False  # the dataset's epochs are done
        if not self.metered:
            return True
        while self._grants and self._grants[0][0] == 0:
            self._grants.pop(0)
        if not self._grants:
            return False
        self._grants[0][0] -= 1
        return True

    def next(self) -> EpisodeSpec:
        if self.signals is not None:
            self._take_requests(self.signals)
        if self._member == 0:
            if not self._start_group():
                raise StopIteration
            if self.current_version is not None and self.signals is not None:
                self.signals.note_started(self._group, self.current_version())
        spec = self.spec(self._group, self._member)
        self._member += 1
        if self._member == self.members_per_group:
            self._group, self._member = self._group + 1, 0
        return spec
