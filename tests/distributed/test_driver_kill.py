"""A driver killed with SIGKILL resumes from its last complete checkpoint, bitwise.

``driver_run.py`` checkpoints after each batch and writes each batch's digest to a
results file. The tests kill it at moments picked from what it reports (after the k-th
batch line, right after it resumed, or while a checkpoint file is half written: it
pauses inside ``save_checkpoint``'s chunked write and says so), restart it, and check
that the finished results equal an uninterrupted run's: every batch, bitwise, none
missing, none twice; and that every batch made twice (before a kill and again after the
resume) came out the same both times. A torn newest checkpoint makes the next start
fall back to the complete one before, with a warning naming it
(``tests/test_checkpoint_files.py`` checks the files themselves: any truncation, any
flipped bit, with hypothesis).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.process
import os
import queue
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from driver_run import PREFIX, PRELOAD, forked_main

from rollpipe.checkpoint import checkpoint_path, partial_path, step_checkpoints

DRIVER = Path(__file__).with_name("driver_run.py")
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(PRELOAD)
DEADLINE_S = 300.0  # for one line from a driver: a hang fails the test, it never waits it out


LIVE: list[Driver] = []  # drivers started and not yet seen to exit


@pytest.fixture(autouse=True)
def _no_driver_left_behind() -> Iterator[None]:
    """A test that fails while a driver runs (or waits to be killed) kills it."""
    yield
    while LIVE:
        driver = LIVE.pop()
        if driver.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                os.kill(driver.proc.pid, signal.SIGKILL)
        driver._wait()


class Driver:
    """One driver process; its stdout lines arrive on a queue as they are printed.

    ``forked``: the process is forked from a fork server that imported torch,
    transformers, vLLM and rollpipe once (``driver_run.PRELOAD``), and so starts in a
    second instead of 5-20 (vLLM's engine is still built in each); else it is a fresh
    interpreter (``python driver_run.py``), as the scripted test's reference run is, so
    that a forked run is checked against one. Either way it is a process of its own,
    killed with SIGKILL, and the run after it knows only what is on disk.
    """

    def __init__(
        self,
        workdir: Path,
        batches: int,
        engine: str,
        pause: str | None = None,
        *,
        forked: bool = False,
        hold_at_end: bool = False,
    ):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"stderr-{len(list(workdir.glob('stderr-*')))}.log"
        argv = [str(workdir), "--batches", str(batches), "--engine", engine]
        argv += [] if pause is None else ["--pause-in-write", pause]
        argv += ["--hold-at-end"] if hold_at_end else []
        self.proc: subprocess.Popen[str] | multiprocessing.process.BaseProcess
        if forked:
            reader, writer = FORKS.Pipe(duplex=False)
            self.proc = FORKS.Process(target=forked_main, args=(argv, writer, str(self.log)))
            self.proc.start()
            writer.close()  # the child's copy is the only writer: its death ends the stream
            self.stdout = os.fdopen(os.dup(reader.fileno()))
            reader.close()
        else:
            env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            with open(self.log, "w") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, str(DRIVER), *argv],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                )
            assert self.proc.stdout is not None
            self.stdout = self.proc.stdout
        LIVE.append(self)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _wait(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            self.proc.wait()
        else:
            self.proc.join()
        if self in LIVE:
            LIVE.remove(self)
        return (
            self.proc.returncode if isinstance(self.proc, subprocess.Popen) else self.proc.exitcode
        )

    def _read(self) -> None:
        for line in self.stdout:  # the driver's lines; vLLM's logs go there too
            if line.startswith(PREFIX):
                self._queue.put(line[len(PREFIX) :].rstrip("\n"))
        self._queue.put(None)

    def next_line(self) -> str | None:
        """The next line the driver prints; None once it has exited."""
        try:
            line = self._queue.get(timeout=DEADLINE_S)
        except queue.Empty:
            raise AssertionError(
                f"the driver printed nothing for {DEADLINE_S} s; {self.tail()}"
            ) from None
        if line is not None:
            self.lines.append(line)
        return line

    def until(self, prefix: str) -> list[str]:
        """Read lines until one starts with ``prefix``; that line's words."""
        while (line := self.next_line()) is not None:
            if line.startswith(prefix):
                return line.split()
            if line == "holding":  # it prints nothing more until it is killed
                raise AssertionError(f"the driver is holding before {prefix!r}; {self.tail()}")
        raise AssertionError(f"the driver exited before printing {prefix!r}; {self.tail()}")

    def kill(self) -> None:
        """SIGKILL, then collect what it printed before it died."""
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self._wait() == -signal.SIGKILL
        while self.next_line() is not None:
            pass

    def finish(self) -> None:
        while self.next_line() is not None:
            pass
        assert self._wait() == 0, self.tail()
        assert self.lines[-1] == "done"

    def tail(self) -> str:
        return f"stdout {self.lines[-5:]}, stderr: {self.log.read_text()[-3000:]}"


def batch_lines(lines: list[str]) -> list[tuple[int, str]]:
    return [(int(w[1]), w[2]) for w in (line.split() for line in lines) if w[0] == "batch"]


def results(workdir: Path) -> list[tuple[int, str]]:
    """The results file's complete lines as (batch, digest)."""
    path = workdir / "results.txt"
    text = path.read_text() if path.exists() else ""
    complete = text[: text.rfind("\n") + 1]
    return [(int(k), d) for k, d in (line.split() for line in complete.splitlines())]


def result_lines(workdir: Path) -> int:
    """Lines in the results file, a torn last one included."""
    path = workdir / "results.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def partials(workdir: Path) -> set[tuple[str, int, int]]:
    """The partial checkpoint files there: (name, size, mtime)."""
    found = (workdir / "checkpoints").glob(".*.partial")
    return {(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in found}


def reference(tmp: Path, batches: int, engine: str, forked: bool) -> list[str]:
    """The uninterrupted run's digests."""
    driver = Driver(tmp / "reference", batches, engine, forked=forked)
    driver.finish()
    ref = results(tmp / "reference")
    assert [k for k, _ in ref] == list(range(batches))
    assert batch_lines(driver.lines) == ref
    assert len({d for _, d in ref}) == batches  # the batches differ: a digest that sees them
    return [d for _, d in ref]


def landing(workdir: Path, killed: Driver, left_before: set[tuple[str, int, int]]) -> str:
    """Where a kill landed, from the files it left (a partial checkpoint file that was
    not there before it started: mid-write) and what the driver had printed."""
    steps = [s for s, _ in step_checkpoints(workdir / "checkpoints")]
    partial = partials(workdir) - left_before
    if partial:
        name, size, _ = partial.pop()
        return f"mid-write ({size} bytes of {name})"
    if "holding" in killed.lines:
        return "held at the end (the kill came after the run's last batch)"
    done = batch_lines(killed.lines)
    if not done:
        return "making the first batch after the resume"
    k = done[-1][0]
    if k in steps:
        return f"after checkpoint {k}, making batch {k + 1}"
    return f"between result {k} and its checkpoint"


def kill_and_resume(
    tmp: Path,
    batches: int,
    engine: str,
    plan: list[tuple[str, int, float]],
    ref: list[str],
    forked: bool,
) -> list[str]:
    """Run the driver, killing it at each point of ``plan`` (kind, offset, fraction) and
    restarting it, then let it finish; check every line against ``ref``. A point's batch
    is ``offset`` after the first one its run makes. Where each kill landed, in order."""
    workdir = tmp / "killed"
    printed: list[tuple[int, str]] = []  # every batch line of every run
    landed: list[str] = []
    last_saved = -1  # the newest checkpoint a driver said it saved
    for i, (kind, offset, fraction) in enumerate([*plan, ("finish", 0, 0.0)]):
        lines_before, left_before = result_lines(workdir), partials(workdir)
        pause = f"{offset}:{fraction}" if kind == "write" else None
        # a kill aimed at a moment cannot arrive after the run ended: it holds at its end
        driver = Driver(
            workdir, batches, engine, pause, forked=forked, hold_at_end=kind != "finish"
        )
        _, resumed, dropped = driver.until("start")
        k = int(resumed) + 1 + offset  # the batch (or checkpoint) to kill at
        assert kind == "finish" or k < batches, "the plan runs past the last batch"
        if i:  # resumed from the newest complete checkpoint: the one said saved, or one
            # saved just before the kill that stopped the line saying so
            assert int(resumed) in (last_saved, last_saved + 1), (resumed, last_saved)
            assert int(dropped) == lines_before - (int(resumed) + 1)
        if kind == "finish":
            driver.finish()
        elif kind == "start":
            driver.kill()
        elif kind == "line":
            driver.until(f"batch {k} ")
            driver.kill()
        else:  # mid-write: the driver waits inside save_checkpoint's chunked write
            _, _, written, total = driver.until(f"writing {k} ")
            partial = partial_path(checkpoint_path(workdir / "checkpoints", k))
            assert partial.stat().st_size == int(written) < int(total)
            assert not checkpoint_path(workdir / "checkpoints", k).exists()
            driver.kill()
        saved = [int(line.split()[1]) for line in driver.lines if line.startswith("saved")]
        last_saved = max([last_saved, *saved])
        printed += batch_lines(driver.lines)
        if kind != "finish":
            landed.append(f"{kind} {k}: {landing(workdir, driver, left_before)}")
    final = results(workdir)
    assert [k for k, _ in final] == list(range(batches)), "a batch missing or twice"
    assert [d for _, d in final] == ref, "a batch after a resume differs from the reference"
    wrong = [(k, d) for k, d in printed if d != ref[k]]
    assert not wrong, f"batches made again after a kill differ: {wrong}"
    assert len(printed) > batches  # some batches were made twice: the kills undid work
    assert not list((workdir / "checkpoints").glob(".*.partial"))
    assert len(step_checkpoints(workdir / "checkpoints")) == 2  # keep=2
    return landed


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
