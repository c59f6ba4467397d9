"""The fault campaign's node_kill and sigkill points (bench/fault_campaign.py): a small
campaign of one run of each counts its points under its kind and loses, duplicates and
hangs nothing, and each kind's own outcome shows in the engines' counts.

``node_kill``: a Ray cluster of several nodes on this machine (``bench.ray_nodes``), the
two engine ranks and the two episode workers each on a node of their own; a point
SIGKILLs one rank's node mid-batch and adds a new one (expand) before the next, or the
workers' node (a new one at once: the workers are replaced, their episodes run again);
its trajectories are compared with the in-process scripted reference. ``sigkill``: the
checkpointing driver (``bench/driver_run.py``) SIGKILLed at random places and resumed;
its batches' digests compared with an uninterrupted run's. The campaign's loop and
accounting on the cheap kinds are ``tests/faults/test_fault_campaign.py``'s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench import fault_campaign as fc

POINTS_PER_RUN = 2


def test_node_kill_and_sigkill_points_lose_duplicate_and_hang_nothing() -> None:
    report = fc.campaign(
        2 * POINTS_PER_RUN,  # exactly the two runs asked for first
        vllm_share=0.0,
        batches=POINTS_PER_RUN,
        seed=1,
        watchdog_s=300.0,  # a bound for a point that never ends, not an expected duration
        min_cluster_runs=1,
        min_driver_runs=1,
        log=lambda _: None,
    )
    assert report["passed"], (report["totals"], report["hung_points"], report["failed_checks"])
    kinds = report["by_fault_kind"]
    assert set(kinds) == {"node_kill", "sigkill"}
    for kind in ("node_kill", "sigkill"):
        counts = kinds[kind]
        # an engine-node point takes the run's next batch too when its first one finds no
        # request in flight (made ahead): one point for both batches
        assert counts["points"] == POINTS_PER_RUN or (kind, counts["points"]) == ("node_kill", 1)
        assert counts["lost"] == counts["duplicated"] == counts["unexpected"] == 0
        assert counts["hangs"] == counts["failed_checks"] == 0
    assert set(report["by_engine"]) == {"cluster", "driver"}
    assert set(report["by_fault_and_episode_kind"]) == {"node_kill/text", "sigkill/text"}

    cluster = report["engines"]["cluster"]
    assert cluster["requests"] > 0
    # the run's points kill an engine rank's node and the episode workers' node in turn,
    # the engine node's point over one batch or more: every batch is a point's
    assert cluster["engine_node_kills"] == 1
    assert cluster["workers_node_kills"] == kinds["node_kill"]["points"] - 1
    assert cluster["engine_node_kill_batches"] + cluster["workers_node_kills"] == POINTS_PER_RUN
    driver = report["engines"]["driver"]
    assert driver["kills"] == POINTS_PER_RUN and driver["restarts"] == POINTS_PER_RUN + 1
    landed = sum(v for k, v in driver.items() if k.startswith("landed_"))
    assert landed == POINTS_PER_RUN and "landed_elsewhere" not in driver
