"""A driver killed with SIGKILL resumes from its last complete checkpoint, bitwise.

``bench/driver_run.py`` checkpoints after each batch and writes each batch's digest to a
results file. The tests kill it at moments picked from what it reports (after the k-th
batch line, right after it resumed, or while a checkpoint file is half written: it
pauses inside ``save_checkpoint``'s chunked write and says so), restart it, and check
that the finished results equal an uninterrupted run's: every batch, bitwise, none
missing, none twice; and that every batch made twice (before a kill and again after the
resume) came out the same both times. A torn newest checkpoint makes the next start
fall back to the complete one before, with a warning naming it
(``tests/test_checkpoint_files.py`` checks the files themselves: any truncation, any
flipped bit, with hypothesis). Starting, killing and resuming drivers is
``bench/driver_kill.py``'s (the fault campaign's ``sigkill`` points use it too).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench.driver_kill import Driver, forks, kill_live, results
from bench.driver_kill import kill_and_resume as run_plan
from bench.driver_kill import reference as reference_run
from rollpipe.checkpoint import step_checkpoints

forks()  # drivers forked from a server that imported torch, transformers, vLLM once


@pytest.fixture(autouse=True)
def _no_driver_left_behind() -> Iterator[None]:
    """A test that fails while a driver runs (or waits to be killed) kills it."""
    yield
    kill_live()


def reference(tmp: Path, batches: int, engine: str, forked: bool) -> list[str]:
    """The uninterrupted run's digests."""
    return reference_run(tmp / "reference", batches, engine, forked)


def kill_and_resume(
    tmp: Path,
    batches: int,
    engine: str,
    plan: list[tuple[str, int, float]],
    ref: list[str],
    forked: bool,
) -> list[str]:
    """Run the driver, killing it at each point of ``plan`` (``bench.driver_kill``) and
    restarting it, then let it finish; check every line against ``ref``. Where each kill
    landed, in order."""
    out = run_plan(tmp / "killed", batches, engine, plan, forked=forked)
    assert not out.notes, out.notes  # each resume from the newest complete checkpoint
    assert [k for k, _ in out.final] == list(range(batches)), "a batch missing or twice"
    assert [d for _, d in out.final] == ref, "a batch after a resume differs from the reference"
    wrong = [(k, d) for k, d in out.printed if d != ref[k]]
    assert not wrong, f"batches made again after a kill differ: {wrong}"
    assert len(out.printed) > batches  # some batches were made twice: the kills undid work
    assert len(step_checkpoints(tmp / "killed" / "checkpoints")) == 2  # keep=2
    return out.landed


def test_scripted_driver_killed_many_times_resumes_bitwise(tmp_path: Path) -> None:
    """Five SIGKILLs at seeded-random points (each kind at least once; the seed from
    ``ROLLPIPE_KILL_SEED`` for a campaign), on the scripted engine."""
    batches, seed = 10, int(os.environ.get("ROLLPIPE_KILL_SEED", "38"))
    rng = random.Random(seed)
    ref = reference(tmp_path, batches, "scripted", forked=False)  # a fresh interpreter
    kinds = ["write", "write", "line", "start", rng.choice(["write", "line"])]
    rng.shuffle(kinds)
    # a run resumes at most 2 batches past its plan point, so 5 kills fit in 10 batches
    plan = [(kind, rng.randint(0, 1), rng.choice([0.0, 0.3, 0.6, 0.9])) for kind in kinds]
    landed = kill_and_resume(tmp_path, batches, "scripted", plan, ref, forked=True)
    print(f"seed {seed}:", *landed, sep="\n  ")
    assert sum(x.split(": ")[1].startswith("mid-write") for x in landed) >= 2

    # a torn newest checkpoint: the next start falls back to the one before and warns
    newest = step_checkpoints(tmp_path / "killed" / "checkpoints")[-1][1]
    newest.write_bytes(newest.read_bytes()[: rng.randint(1, newest.stat().st_size - 1)])
    driver = Driver(tmp_path / "killed", batches, "scripted", forked=True)
    assert driver.until("start")[1:] == [str(batches - 2), "1"]
    driver.finish()
    assert [d for _, d in results(tmp_path / "killed")] == ref
    assert "CheckpointWarning" in driver.log.read_text() and newest.name in driver.log.read_text()


def test_vllm_driver_killed_mid_write_and_after_a_batch_resumes_bitwise(tmp_path: Path) -> None:
    """The real vLLM engine on the tiny model: one kill mid-checkpoint-write, one right
    after a batch line; the batches after each resume equal the uninterrupted run's."""
    batches = 4
    rng = random.Random(int(os.environ.get("ROLLPIPE_KILL_SEED", "38")))
    ref = reference(tmp_path, batches, "vllm", forked=True)
    plan = [("write", 1, rng.choice([0.0, 0.5, 0.9])), ("line", 1, 0.0)]
    landed = kill_and_resume(tmp_path, batches, "vllm", plan, ref, forked=True)
    print(*landed, sep="\n  ")
    assert landed[0].split(": ")[1].startswith("mid-write")
