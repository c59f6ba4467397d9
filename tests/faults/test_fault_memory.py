"""Bookkeeping stays bounded on an endless stream: the ids of closed and cancelled
groups are forgotten once no member of them can arrive (issue 17's memory creep: the
assembler's set of closed group ids grew for ever)."""

from __future__ import annotations

from typing import Any

from faulty import config

from rollpipe.pipeline import RolloutPipeline


def drop_odd(group: Any) -> bool:
    return group.group_id % 2 == 1


def test_closed_and_cancelled_ids_stay_bounded(vllm_engine: Any, tokenizer: Any) -> None:
    cfg = config(
        "inline_fault_lake",
        env_config={"fault": "raise_step", "rate": 0.2},
        redundancy=1,  # every kept group cancels its spare member
        drop_group=drop_odd,  # half the groups are dropped (and cancelled)
        batch_size=8,
    )
    sizes = []
    with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
        for _ in range(12):
            assert len(pipe.get_batch()) == 8
            sizes.append((len(pipe.nodes.groups._closed), len(pipe.nodes.signals._cancelled)))
        closed_total = sum(pipe.nodes.groups.total_drops.values())
        settled = pipe.nodes.signals.settled_below
    assert settled > 60  # 48 groups kept, about as many dropped: their ids were settled
    bound = cfg.concurrency + 4 * cfg.concurrency  # episodes the rollout may still hold
    assert max(c for c, _ in sizes) <= bound and max(c for _, c in sizes) <= bound, sizes
    assert closed_total > 0
    print(f"FIGURE bookkeeping settled={settled} max_closed_cancelled={max(sizes)}")
