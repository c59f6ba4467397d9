"""RolloutPipeline: the ready-made chain from one config to ``DataProto`` batches.

    EpisodeSource → Rollout → GroupAssembler → Batch → Collate → Pausable

``build_nodes`` wires the chain functionally (and lets you insert your own nodes
between stages); ``RolloutPipeline`` wraps it in a ``torchdata.nodes.Loader`` and adds
ROLL's ``get_batch`` / ``suspend`` / ``resume`` and checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
from torchdata.nodes import BaseNode, Loader

from rollpipe._utils.checks import int_at_least, optional
from rollpipe.agent.chat import DEFAULT_SYSTEM_PROMPT, ChatFormat
from rollpipe.data.proto import DataProto
from rollpipe.engines.base import Engine, SamplingParams
from rollpipe.envs import available as available_envs
from rollpipe.nodes.batch import Batch
from rollpipe.nodes.collate import Collate
from rollpipe.nodes.episode_source import EnvChoice, EpisodeSource, as_env_choices
from rollpipe.nodes.groups import FILTERS, GroupAssembler
from rollpipe.nodes.pausable import Pausable, PauseController, PauseMode
from rollpipe.nodes.rollout import Rollout
from rollpipe.nodes.signals import RolloutControl

Stage = Literal["source", "rollout", "groups", "batch", "collate"]
NodeHook = Callable[[BaseNode[Any]], BaseNode[Any]]


def _sampling(value: SamplingParams | Mapping[str, Any]) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    valid = sorted(f.name for f in attrs.fields(SamplingParams))
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ValueError(f"PipelineConfig.sampling: unknown keys {unknown}; valid keys: {valid}")
    return SamplingParams(**value)


def _envs(value: Any) -> tuple[EnvChoice, ...]:
    if isinstance(value, (str, EnvChoice)):
        value = [value]
    items = [EnvChoice(**v) if isinstance(v, Mapping) else v for v in value]
    choices = as_env_choices(items)
    known = available_envs()
    for c in choices:
        if c.name not in known:
            raise ValueError(f"PipelineConfig.envs: unknown env {c.name!r}; registered: {known}")
    return choices


@attrs.frozen(kw_only=True)
class PipelineConfig:
    """Everything the standard chain needs. Bad values fail here, naming the field.

    ``envs`` takes an env name, an :class:`EnvChoice`, or a list mixing several by
    weight (YAML: ``[{name: sokoban, weight: 1, config: {dim_room: [6, 6]}}]``).
    ``batch_size`` counts trajectories and must be a multiple of ``group_size``.
    ``num_groups=None`` runs forever. ``in_order=None`` (auto) yields trajectories in
    admission order — reproducible — unless ``redundancy`` is set, where completion
    order lets the first finishers of a group win.
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
    engine_loop: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    sampling: SamplingParams = attrs.field(
        factory=lambda: SamplingParams(max_tokens=48), converter=_sampling
    )
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    history_window: int | None = None
    level: Literal["trajectory", "step"] = attrs.field(
        default="trajectory", validator=attrs.validators.in_(("trajectory", "step"))
    )
    pad_to_multiple_of: int | None = attrs.field(default=None, validator=optional(int_at_least(1)))
    filter: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(tuple(FILTERS)))
    )
    max_staleness: int | None = None
    max_drops_in_a_row: int = attrs.field(default=1000, validator=int_at_least(1))
    in_order: bool | None = None
    raise_env_errors: bool = False
    on_length: Literal["skip", "step", "end"] = "skip"

    def __attrs_post_init__(self) -> None:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"PipelineConfig.batch_size={self.batch_size} is not a multiple of "
                f"group_size={self.group_size}; batches hold whole groups"
            )
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(
                f"PipelineConfig.max_staleness must be >= 0 or None, got {self.max_staleness}"
            )
        if self.level == "step" and self.history_window is None:
            raise ValueError(
                "PipelineConfig.level='step' needs history_window (e.g. 2): step rows "
                "show a bounded window of recent turns"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineConfig:
        """From plain data (YAML); an unknown key is an error listing the valid ones."""
        valid = sorted(f.name for f in attrs.fields(cls))
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ValueError(f"PipelineConfig: unknown keys {unknown}; valid keys: {valid}")
        return cls(**data)

    def replace(self, **changes: Any) -> PipelineConfig:
        return attrs.evolve(self, **changes)


@attrs.frozen
class PipelineNodes:
    """The wired stages, for users who want to hold or extend them."""

    control: RolloutControl
    controller: PauseController
    source: EpisodeSource
    rollout: Rollout
    groups: GroupAssembler
    batch: Batch
    collate: Collate
    root: BaseNode[DataProto]


def build_nodes(
    config: PipelineConfig,
    engine: Engine,
    tokenizer: Any,
    *,
    hooks: Mapping[Stage, NodeHook] | None = None,
) -> PipelineNodes:
    """Wire the standard chain. ``hooks[stage]`` wraps that stage's output node, e.g.
    ``{"rollout": lambda n: torchdata.nodes.Mapper(n, add_reward_model_score)}``."""
    hooks = dict(hooks or {})
    unknown = sorted(set(hooks) - {"source", "rollout", "groups", "batch", "collate"})
    if unknown:
        raise ValueError(
            f"build_nodes: unknown hook stages {unknown}; use source, rollout, groups, "
            "batch or collate"
        )

    def hooked(stage: Stage, node: BaseNode[Any]) -> BaseNode[Any]:
        return hooks[stage](node) if stage in hooks else node

    control = RolloutControl()
    controller = PauseController(engine, control)
    chat = ChatFormat(
        tokenizer, system_prompt=config.system_prompt, history_window=config.history_window
    )
    source = EpisodeSource(
        config.num_groups,
        config.group_size,
        config.seed,
        config.envs,
        redundancy=config.redundancy,
        control=control,
    )
    rollout = Rollout(
        hooked("source", source),
        engine,
        chat,
        sampling=config.sampling,
        max_turns=config.max_turns,
        max_length=config.max_length,
        concurrency=config.concurrency,
        env_workers=config.env_workers,
        engine_loop=config.engine_loop,
        in_order=config.redundancy == 0 if config.in_order is None else config.in_order,
        control=control,
        raise_env_errors=config.raise_env_errors,
        on_length=config.on_length,
    )
    groups = GroupAssembler(
        hooked("rollout", rollout),
        config.group_size,
        redundancy=config.redundancy,
        filter=config.filter,
        max_staleness=config.max_staleness,
        current_version=lambda: engine.version,
        control=control,
        max_drops_in_a_row=config.max_drops_in_a_row,
    )
    batch = Batch(hooked("groups", groups), config.batch_size)
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    collate = Collate(
        hooked("batch", batch),
        pad_id,
        pad_to_multiple_of=config.pad_to_multiple_of,
        level=config.level,
    )
    root: Pausable[DataProto] = Pausable(hooked("collate", collate), controller)
    return PipelineNodes(control, controller, source, rollout, groups, batch, collate, root)


class RolloutPipeline:
    """Iterate it for ``DataProto`` batches; drive it like ROLL's RolloutScheduler.

    >>> with RolloutPipeline(PipelineConfig(), engine, tokenizer) as pipe:
    ...     batch = pipe.get_batch(16)
    ...     with pipe.suspended():
    ...         pipe.update_weights(policy)

    The engine belongs to the caller unless ``owns_engine=True``.
    """

    def __init__(
        self,
        config: PipelineConfig,
        engine: Engine,
        tokenizer: Any,
        *,
        hooks: Mapping[Stage, NodeHook] | None = None,
        owns_engine: bool = False,
    ) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.owns_engine = owns_engine
        self.nodes = build_nodes(config, engine, tokenizer, hooks=hooks)
        self._loader = Loader(self.nodes.root, restart_on_stop_iteration=False)
        self._iter: Iterator[DataProto] | None = None
        self._closed = False

    # -- data -------------------------------------------------------------------------
    def _iterator(self) -> Iterator[DataProto]:
        if self._closed:
            raise RuntimeError("RolloutPipeline is closed; build a new one")
        if self._iter is None:
            self._iter = iter(self._loader)
        return self._iter

    def __iter__(self) -> Iterator[DataProto]:
        return self

    def __next__(self) -> DataProto:
        return next(self._iterator())

    def get_batch(self, batch_size: int | None = None) -> DataProto | None:
        """A batch of ``batch_size`` trajectories (default: the config's), blocking until
        filled; ``-1`` drains a finite source into one batch; None when nothing is left.
        """
        size = self.config.batch_size if batch_size is None else batch_size
        if size != -1 and (size < 1 or size % self.config.group_size):
            raise ValueError(
                f"get_batch: batch_size={size} must be -1 or a positive multiple of "
                f"group_size={self.config.group_size}"
            )
        if size == -1 and self.config.num_groups is None:
            raise ValueError("get_batch(-1) drains a finite source; set num_groups in the config")
        self.nodes.batch.num_trajectories = size
        try:
            return next(self._iterator())
        except StopIteration:
            return None
        finally:
            self.nodes.batch.num_trajectories = self.config.batch_size

    # -- weights ----------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The engine's current policy version."""
        return self.engine.version

    def suspend(self, mode: PauseMode = "keep") -> None:
        self.nodes.controller.suspend(mode)

    def resume(self) -> None:
        self.nodes.controller.resume()

    def suspended(self, mode: PauseMode = "keep") -> Any:
        """Context manager: suspend on entry, resume on exit."""
        return self.nodes.controller.suspended(mode)

    def update_weights(self, weights: Any, version: int | None = None) -> int:
        return self.nodes.controller.update_weights(weights, version=version)

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands; a fresh pipeline loading it yields what this one would."""
        self._iterator()
        return {"loader": self._loader.state_dict(), "control": self.nodes.control.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.nodes.control.load_state(state["control"])
        self._loader.load_state_dict(state["loader"])
        self._iter = iter(self._loader)

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Stop episodes and env threads (and the engine if owned). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.nodes.controller.is_suspended:
            self.nodes.controller.resume()
        self.nodes.rollout.close()
        if self.owns_engine:
            self.engine.close()

    def __enter__(self) -> RolloutPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
