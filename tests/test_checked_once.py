"""Each argument rule lives in one place, the stage's settings record: a node given a bad
value directly and a ``PipelineConfig`` given the same value fail with the same message
(naming whichever the user wrote: the node, or the record)."""

from __future__ import annotations

from typing import Any

import pytest
from torchdata.nodes import IterableWrapper

from rollpipe.config import PipelineConfig
from rollpipe.nodes.collate import Collate
from rollpipe.nodes.episode_source import EpisodeSource
from rollpipe.nodes.groups import GroupAssembler

EMPTY = IterableWrapper([])

# (field, bad value, the node built directly with it, the record its config section names)
CASES: list[tuple[str, Any, Any, str]] = [
    ("group_size", 0, lambda v: EpisodeSource(1, v), "SourceSettings"),
    ("redundancy", -1, lambda v: EpisodeSource(1, 2, redundancy=v), "SourceSettings"),
    ("seed", 2**70, lambda v: EpisodeSource(1, 2, seed=v), "SourceSettings"),
    ("group_size", 10**9, lambda v: GroupAssembler(EMPTY, v), "SourceSettings"),
    ("drop_group", "nope", lambda v: GroupAssembler(EMPTY, 2, drop_group=v), "GroupSettings"),
    (
        "max_drops_in_a_row",
        0,
        lambda v: GroupAssembler(EMPTY, 2, max_drops_in_a_row=v),
        "GroupSettings",
    ),
    (
        "max_error_seconds",
        -1.0,
        lambda v: GroupAssembler(EMPTY, 2, max_error_seconds=v),
        "GroupSettings",
    ),
    ("level", "turn", lambda v: Collate(EMPTY, 0, level=v), "CollateSettings"),
    (
        "pad_to_multiple_of",
        0,
        lambda v: Collate(EMPTY, 0, pad_to_multiple_of=v),
        "CollateSettings",
    ),
]


def _message(build: Any) -> str:
    with pytest.raises(ValueError) as info:
        build()
    return str(info.value)


@pytest.mark.parametrize(("field", "value", "node", "record"), CASES)
def test_a_bad_value_fails_alike_on_the_node_and_in_the_config(
    field: str, value: Any, node: Any, record: str
) -> None:
    direct = _message(lambda: node(value))
    configured = _message(lambda: PipelineConfig(**{field: value}))
    owner = direct.partition(".")[0]
    assert owner in ("EpisodeSource", "GroupAssembler", "Collate"), direct
    assert repr(value) in direct
    # the same check: the same message, but for the name the user wrote
    assert direct.replace(f"{owner}.", f"{record}.", 1) == configured
