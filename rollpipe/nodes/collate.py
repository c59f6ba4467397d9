"""Collate: trajectory records to one padded ``DataProto``.

Token-in/token-out: rows are the exact ids the engine saw and produced (see
``rollpipe.data.rows``). Padding happens here, once, to the longest row of what
arrives (optionally rounded up to a multiple), never to a global sequence length.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import attrs
from torchdata.nodes import BaseNode

from rollpipe._utils.checks import check_fields, int_in, one_of, optional
from rollpipe.agent.records import Group, Trajectory
from rollpipe.data.metrics import batch_metrics
from rollpipe.data.proto import DataProto
from rollpipe.data.rows import step_rows, trajectory_rows
from rollpipe.nodes.batch import TrajectoryBatch

Level = Literal["trajectory", "step"]
Layout = Literal["native", "roll", "verl"]
MAX_PAD_MULTIPLE = 65536


@attrs.frozen(kw_only=True)
class CollateSettings:
    """How trajectories become rows (``PipelineConfig.collate``), checked here once.

    ``level``: ``"trajectory"`` (a row per episode; needs whole conversations, i.e.
    ``EpisodeSettings.history_window=None``) or ``"step"`` (a row per turn, GiGPO style;
    needs a ``history_window``). ``pad_to_multiple_of``: round the padded width up to a
    multiple (at most ``MAX_PAD_MULTIPLE``; None: the longest row). ``layout``:
    ``"native"`` rows, ``"roll"`` (``DataProto.to_roll()``) or ``"verl"`` (``to_verl()``,
    needs verl), converted once per batch.

    Examples:
        >>> CollateSettings(level="step", pad_to_multiple_of=8).layout
        'native'
        >>> CollateSettings(level="turn")
        Traceback (most recent call last):
        ...
        ValueError: ...level...
    """

    level: Level = attrs.field(default="trajectory", validator=one_of("trajectory", "step"))
    pad_to_multiple_of: int | None = attrs.field(
        default=None, validator=optional(int_in(1, MAX_PAD_MULTIPLE))
    )
    layout: Layout = attrs.field(default="native", validator=one_of("native", "roll", "verl"))


def merge_tag_drops(groups: Iterable[Group]) -> dict[str, dict[str, int]]:
    """The groups' per-tag drop counts, summed (as ``Batch`` sums their ``drops``)."""
    merged: dict[str, Counter[str]] = {}
    for group in groups:
        for tag, counts in group.tag_drops.items():
            merged.setdefault(tag, Counter()).update(counts)
    return {tag: dict(counts) for tag, counts in merged.items()}


class Collate(BaseNode[DataProto]):
    """Turns a :class:`TrajectoryBatch`, a :class:`Group` or a list of trajectories into rows.

    ``level="trajectory"`` gives one row per trajectory (an agent trajectory whose calls
    do not extend each other: one per part, ``Turn.new_row``); ``level="step"`` one row
    per turn (GiGPO style). ``docs/dataproto.md`` lists every field. Metrics of the
    trajectories, overall and per env tag, go to
    ``meta_info["metrics"]``; the errored trajectories dropped before these groups (the
    most recent ``MAX_ERRORS_KEPT`` per group; ``dropped/errored_trajectories`` counts
    them all) to ``meta_info["env_errors"]``: dicts with ``env``, ``tag``, ``seed``,
    ``group_id``, ``episode_id``, ``turn`` and ``message`` (the exception and where).

    Examples:
        >>> from torchdata.nodes import IterableWrapper
        >>> from rollpipe.agent.records import EpisodeSpec, Turn
        >>> def traj(episode, response):  # one turn: 3 prompt ids, then the response
        ...     n = len(response)
        ...     turn = Turn([7, 8, 9], response, [-0.5] * n, [0] * n, 1.0, "stop", True, "", "")
        ...     return Trajectory(EpisodeSpec(0, episode, 0), 0, [turn], 1.0, True, "terminated")
        >>> group = Group(0, [traj(0, [4, 2]), traj(1, [5])])
        >>> rows = next(Collate(IterableWrapper([group]), pad_token_id=0))
        >>> rows.batch["input_ids"].tolist()  # padded once, to the longest row
        [[7, 8, 9, 4, 2], [7, 8, 9, 5, 0]]
        >>> rows.batch["response_mask"].int().tolist(), rows.meta_info["metrics"]["trajectories"]
        ([[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]], 2.0)
    """

    def __init__(
        self,
        source: BaseNode[Any],
        pad_token_id: int,
        *,
        pad_to_multiple_of: int | None = None,
        level: Level = "trajectory",
    ) -> None:
        super().__init__()
        # CollateSettings' checks, the one place these rules live
        check_fields("Collate", CollateSettings, level=level, pad_to_multiple_of=pad_to_multiple_of)
        self.source = source
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.level = level

    @classmethod
    def from_settings(
        cls, source: BaseNode[Any], pad_token_id: int, settings: CollateSettings
    ) -> Collate:
        """The node ``settings`` describe (the layout is converted after it, by the chain)."""
        return cls(
            source,
            pad_token_id,
            pad_to_multiple_of=settings.pad_to_multiple_of,
            level=settings.level,
        )

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict()}

    def collate(self, item: TrajectoryBatch | Group | Sequence[Trajectory]) -> DataProto:
        """Rows and metrics for one item (usable without a source, e.g. in a map)."""
        if isinstance(item, TrajectoryBatch):
            trajectories = item.trajectories
            metrics = batch_metrics(
                trajectories,
                item.drops,
                item.wall_time_s,
                item.stream_time_s,
                item.stream_tokens,
                tag_drops=merge_tag_drops(item.groups),
            )
            errors = [dict(e) for g in item.groups for e in g.errors]
        elif isinstance(item, Group):
            trajectories = list(item.trajectories)
            metrics = batch_metrics(trajectories, item.drops, tag_drops=item.tag_drops)
            errors = [dict(e) for e in item.errors]
        else:
            trajectories = list(item)
            metrics = batch_metrics(trajectories)
            errors = []
        to_rows = trajectory_rows if self.level == "trajectory" else step_rows
        rows = to_rows(trajectories, self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of)
        rows.meta_info["metrics"] = metrics
        rows.meta_info["env_errors"] = errors
        return rows

    def next(self) -> DataProto:
        return self.collate(next(self.source))
