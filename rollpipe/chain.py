"""build_nodes: the standard chain, wired functionally from one ``PipelineConfig``.

    EpisodeSource → EpisodeRunner → GroupAssembler → Batch → Collate → Pausable

``hooks`` insert your own nodes after any stage. ``RolloutPipeline`` (``pipeline.py``)
wraps the chain in a ``torchdata.nodes.Loader``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import methodcaller
from typing import Any, Literal

import attrs
from torchdata.nodes import BaseNode, Mapper

from rollpipe.config import PipelineConfig
from rollpipe.data.proto import DataProto
from rollpipe.engines.protocol import Engine
from rollpipe.envs.pool import EnvForSpec
from rollpipe.nodes.batch import Batch
from rollpipe.nodes.collate import Collate
from rollpipe.nodes.episode_source import EpisodeSource
from rollpipe.nodes.groups import GroupAssembler
from rollpipe.nodes.pausable import Pausable
from rollpipe.nodes.rollout import EpisodeRunner
from rollpipe.nodes.signals import PipelineSignals
from rollpipe.nodes.suspension import Suspension

__all__ = ["NodeHook", "PipelineNodes", "Stage", "build_nodes"]

Stage = Literal["source", "rollout", "groups", "batch", "collate"]
NodeHook = Callable[[BaseNode[Any]], BaseNode[Any]]


@attrs.frozen
class PipelineNodes:
    """The wired stages, for users who want to hold or extend them.

    Examples:
        >>> from rollpipe import ScriptedEngine
        >>> with ScriptedEngine(lambda *_: []) as scripted:
        ...     nodes = build_nodes(PipelineConfig(group_size=2, batch_size=6), scripted, tokenizer)
        ...     print(nodes.source.group_size, nodes.batch.num_trajectories)
        ...     print(nodes.batch.source is nodes.groups, nodes.collate.source is nodes.batch)
        ...     nodes.root.close()  # closes every stage before it too
        2 6
        True True
    """

    signals: PipelineSignals  # cancellations, grants, replacements (flow upstream)
    suspension: Suspension  # suspend / resume / update_weights; admission reads it
    source: EpisodeSource
    rollout: EpisodeRunner
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
    name: str = "pipeline",
    env_factory: EnvForSpec | None = None,
) -> PipelineNodes:
    """Wire the standard chain. ``hooks[stage]`` wraps that stage's output node, e.g.
    ``{"rollout": lambda n: torchdata.nodes.Mapper(n, add_reward_model_score)}``;
    ``name`` names the pipeline in the suspension's messages. ``env_factory`` builds each
    env slot's env from its spec, in place of the one ``config.rollout.env_backend`` names:
    e.g. ``ray_env_factory(actor_options={"resources": {"envs": 0.01}})`` places the Ray
    env workers on the nodes that have that custom resource (docs/ray-envs.md).

    Examples:
        Without ``async_generation_ratio`` the source needs no grants (``RolloutPipeline``
        grants each ``get_batch``'s groups); a hook after the groups sees each group:

        >>> from rollpipe import ScriptedEngine
        >>> config = PipelineConfig(group_size=2, batch_size=4, num_groups=2, max_turns=1,
        ...                         async_generation_ratio=None)
        >>> seen = []
        >>> record = lambda group: seen.append(group.group_id) or group
        >>> with ScriptedEngine(lambda *_: []) as scripted:
        ...     nodes = build_nodes(config, scripted, tokenizer,
        ...                         hooks={"groups": lambda node: Mapper(node, record)})
        ...     print([len(batch) for batch in nodes.root], seen)
        ...     nodes.root.close()
        [4] [0, 1]
    """
    hooks = dict(hooks or {})
    unknown = sorted(set(hooks) - {"source", "rollout", "groups", "batch", "collate"})
    if unknown:
        raise ValueError(
            f"build_nodes: unknown hook stages {unknown}; use source, rollout, groups, "
            "batch or collate"
        )

    engine_limit = getattr(engine, "max_model_len", None)
    max_length = config.episode.max_length
    if isinstance(engine_limit, int) and max_length > engine_limit:
        raise ValueError(
            f"EpisodeSettings.max_length={max_length} is more than the engine's "
            f"max_model_len={engine_limit}: the first long conversation would fail in the "
            "engine; lower max_length or build the engine with a larger max_model_len"
        )

    def hooked(stage: Stage, node: BaseNode[Any]) -> BaseNode[Any]:
        return hooks[stage](node) if stage in hooks else node

    suspension = Suspension(engine, name=name)
    signals = PipelineSignals(suspension)
    ratio = config.async_generation_ratio
    wait = config.max_off_policy_strategy == "wait"  # else drop (see PipelineConfig)

    def version() -> int:
        return engine.version

    source = EpisodeSource.from_settings(
        config.source,
        signals=signals,
        metered=ratio is not None,
        expire_after=None if wait else ratio,  # waiting, an unstarted grant is never stale
        current_version=version if wait else None,  # the ledger the Batch waits on
    )
    rollout = EpisodeRunner(
        hooked("source", source),
        engine,
        config.episode.chat_format(tokenizer),
        attrs.evolve(config.rollout, in_order=config.admission_order),
        config.episode,
        signals=signals,
        env_factory=_env_factory(config) if env_factory is None else env_factory,
    )
    groups = GroupAssembler.from_settings(
        hooked("rollout", rollout),
        config.groups,
        config.source.group_size,
        redundancy=config.source.redundancy,
        max_staleness=None if wait else ratio,  # waiting, the Batch keeps groups fresh
        current_version=version,
        signals=signals,
    )
    batch = Batch(
        hooked("groups", groups),
        config.batch_size,
        max_staleness=ratio,
        current_version=version,
        signals=signals,
        wait=wait,
    )
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    collate = Collate.from_settings(hooked("batch", batch), pad_id, config.collate)
    rows: BaseNode[Any] = hooked("collate", collate)
    layout = config.collate.layout
    if layout != "native":  # ROLL's or verl's layout, converted once per batch
        rows = Mapper(rows, methodcaller(f"to_{layout}"))
    root: Pausable[DataProto] = Pausable(rows, suspension)
    return PipelineNodes(signals, suspension, source, rollout, groups, batch, collate, root)


def _env_factory(config: PipelineConfig) -> Any:
    """``env_backend="ray"``: each env slot's env in a Ray actor (``rollpipe.envs.ray_env``);
    ``"local"``: the registry's env in this process (None: the EpisodeRunner's default)."""
    if config.rollout.env_backend == "local":
        return None
    from rollpipe.envs.ray_env import ray_env_factory

    return ray_env_factory()
