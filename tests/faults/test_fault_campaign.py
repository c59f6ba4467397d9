"""The fault campaign (bench/fault_campaign.py) on its scripted engine pool: its loop and
accounting are what is tested here (the campaign's own vLLM points run in the bench).

A small campaign passes with every fault kind and episode kind drawn; a fault kind that
restarts the pipeline without its checkpoint is caught as lost and duplicated
trajectories; a point that never finishes is reported as a hang, naming the point, by
the watchdog closing its pipeline.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench import fault_campaign as fc
from rollpipe.data.proto import DataProto


def small(points: int, **kw: float) -> dict:
    options = dict(vllm_share=0.0, batches=6, seed=3, watchdog_s=300.0)
    return fc.campaign(points, **(options | kw), log=lambda _: None)


def test_a_small_campaign_loses_duplicates_and_hangs_nothing() -> None:
    report = small(90)
    assert report["passed"], report["totals"]
    assert report["points"] >= 90
    # every kind for the engines it ran on (no run on episode workers here: worker_kill)
    used = set(report["by_engine"])
    assert set(report["by_fault_kind"]) == {
        k.name for k in fc.FAULTS.values() if used & set(k.engines)
    }
    assert set(report["by_episode_kind"]) == set(fc.EPISODE_KINDS)
    for counts in report["by_fault_and_episode_kind"].values():
        assert counts["lost"] == counts["duplicated"] == counts["hangs"] == 0
    scripted = report["engines"]["scripted"]
    assert scripted["requests"] > 0
    # points land on requests in flight: some were aborted (and regenerated) or re-sent
    assert scripted["aborted"] + scripted["rerouted_by_shrink"] > 0


def restart_without_state(run: fc.Run, rng: random.Random) -> DataProto:
    """A broken restore: a fresh pipeline that forgets where the stream stood."""
    run.replace_pipeline()
    batch = run.pipe.get_batch()
    assert batch is not None
    return batch


def hold_forever(run: fc.Run, rng: random.Random) -> DataProto:
    """A held suspend that nobody resumes: get_batch waits until the pipeline closes."""
    return run.during_batch(rng, lambda: run.pipe.suspend("keep", hold=True))


def only(kind: fc.FaultKind, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fc, "FAULTS", {kind.name: kind})


def test_a_restore_that_forgets_the_stream_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    only(fc.FaultKind("forgetful", restart_without_state, "loses its place"), monkeypatch)
    report = small(12)
    counts = report["by_fault_kind"]["forgetful"]
    assert counts["duplicated"] > 0 and counts["lost"] > 0
    assert not report["passed"]


def test_a_point_that_never_ends_is_reported_as_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    only(fc.FaultKind("held", hold_forever, "never resumed"), monkeypatch)
    report = small(1, watchdog_s=1.0)  # the point never ends by itself: any bound works
    assert report["totals"]["hangs"] == 1 and not report["passed"]
    (hung,) = report["hung_points"]
    assert hung["point"].startswith("held on text/scripted, seed ") and "batch 0" in hung["point"]
    assert "RuntimeClosedError" in hung["error"]


def test_a_fault_kind_is_registered_by_name() -> None:
    with pytest.raises(ValueError, match="'checkpoint' is registered already"):
        fc.fault_kind("checkpoint", expected="twice")(restart_without_state)
    assert {"suspend_keep", "suspend_abort", "suspend_wait", "checkpoint", "shrink_expand"} <= set(
        fc.FAULTS
    )
