"""Start, SIGKILL and resume the checkpointing driver (``bench/driver_run.py``).

:class:`Driver` is one driver process whose ``@driver`` lines arrive on a queue, so a
kill moment is picked from what it reports (never from elapsed time).
:func:`kill_and_resume` runs it through a plan of kills, restarting it after each, and
returns what came out: the results file, every batch line any run printed, where each
kill landed, and what went against the resume rules. Used by
``tests/distributed/test_driver_kill.py`` (which asserts on it) and by the fault
campaign's ``sigkill`` points (which count it).

A plan point is ``(kind, offset, fraction)``: ``"start"`` kills the run right after it
resumed (while it makes its first batch), ``"line"`` right after the line of the batch
``offset`` past its first (between that batch and its checkpoint, or just after the
checkpoint), ``"write"`` while that batch's checkpoint file is ``fraction`` written (the
driver pauses inside ``save_checkpoint``'s chunked write). A run resumes at most 2
batches past its plan point, so ``n`` kills with offsets 0-1 fit in ``2 n`` batches.
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
from pathlib import Path
from typing import IO, Any

import attrs

from bench.driver_run import PREFIX, PRELOAD, forked_main
from rollpipe.checkpoint import checkpoint_path, partial_path, step_checkpoints

DRIVER = Path(__file__).with_name("driver_run.py")
DEADLINE_S = 300.0  # for one line from a driver: a hang fails, it is never waited out
KINDS = ("start", "line", "write")

LIVE: list[Driver] = []
"""Drivers started and not yet seen to exit (:func:`kill_live` ends them)."""


class DriverSilent(AssertionError):
    """A driver printed nothing for its deadline: a hang."""


def forks(preload: list[str] = PRELOAD) -> Any:
    """The fork-server context drivers are forked from, importing ``preload`` once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    return context


def kill_live() -> None:
    """SIGKILL every driver still in :data:`LIVE` (a failed test's or point's)."""
    while LIVE:
        driver = LIVE.pop()
        if driver.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                os.kill(driver.proc.pid, signal.SIGKILL)
        driver._wait()


class Driver:
    """One driver process; its stdout lines arrive on a queue as they are printed.

    ``forked``: the process is forked from a fork server that imported torch,
    transformers (vLLM) and rollpipe once (:func:`forks`), and so starts in a second
    instead of 5-20 (vLLM's engine is still built in each); else it is a fresh
    interpreter (``python bench/driver_run.py``), so that a forked run can be checked
    against one. Either way it is a process of its own, killed with SIGKILL, and the run
    after it knows only what is on disk.
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
        deadline_s: float = DEADLINE_S,
    ):
        self.workdir, self.deadline_s = workdir, deadline_s
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"stderr-{len(list(workdir.glob('stderr-*')))}.log"
        argv = [str(workdir), "--batches", str(batches), "--engine", engine]
        argv += [] if pause is None else ["--pause-in-write", pause]
        argv += ["--hold-at-end"] if hold_at_end else []
        self.proc: subprocess.Popen[str] | multiprocessing.process.BaseProcess
        self.stdout: IO[str]
        if forked:
            context = multiprocessing.get_context("forkserver")
            reader, writer = context.Pipe(duplex=False)
            self.proc = context.Process(target=forked_main, args=(argv, writer, str(self.log)))
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
            line = self._queue.get(timeout=self.deadline_s)
        except queue.Empty:
            raise DriverSilent(
                f"the driver printed nothing for {self.deadline_s} s; {self.tail()}"
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
        code = self._wait()
        assert code == -signal.SIGKILL, f"the driver ended with {code}, not by SIGKILL"
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


def reference(workdir: Path, batches: int, engine: str, forked: bool) -> list[str]:
    """The uninterrupted run's digests (in ``workdir``, which must be new)."""
    driver = Driver(workdir, batches, engine, forked=forked)
    driver.finish()
    ref = results(workdir)
    assert [k for k, _ in ref] == list(range(batches)), ref
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


def random_plan(rng: random.Random, kills: int) -> list[tuple[str, int, float]]:
    """``kills`` plan points of random kinds, offsets and write fractions."""
    return [
        (rng.choice(KINDS), rng.randint(0, 1), rng.choice([0.0, 0.3, 0.6, 0.9]))
        for _ in range(kills)
    ]


@attrs.frozen
class Resumed:
    """What a killed-and-resumed run left: ``final`` (the results file: (batch, digest)),
    ``printed`` (every batch line of every run, a batch made twice twice), ``landed``
    (where each kill landed, in order), ``notes`` (resume rules broken: empty if none)."""

    final: list[tuple[int, str]]
    printed: list[tuple[int, str]]
    landed: list[str]
    notes: list[str]


def kill_and_resume(
    workdir: Path,
    batches: int,
    engine: str,
    plan: list[tuple[str, int, float]],
    *,
    forked: bool,
    deadline_s: float = DEADLINE_S,
) -> Resumed:
    """Run the driver in ``workdir``, killing it at each point of ``plan`` and restarting
    it, then let it finish. A point's batch is ``offset`` after the first one its run
    makes. Raises :class:`DriverSilent` if a driver goes silent past ``deadline_s``."""
    printed: list[tuple[int, str]] = []
    landed, notes = [], []
    last_saved = -1  # the newest checkpoint a driver said it saved
    for i, (kind, offset, fraction) in enumerate([*plan, ("finish", 0, 0.0)]):
        lines_before, left_before = result_lines(workdir), partials(workdir)
        pause = f"{offset}:{fraction}" if kind == "write" else None
        # a kill aimed at a moment cannot arrive after the run ended: it holds at its end
        driver = Driver(
            workdir,
            batches,
            engine,
            pause,
            forked=forked,
            hold_at_end=kind != "finish",
            deadline_s=deadline_s,
        )
        _, resumed, dropped = driver.until("start")
        k = int(resumed) + 1 + offset  # the batch (or checkpoint) to kill at
        if kind != "finish" and k >= batches:
            raise ValueError(f"the plan {plan} runs past the last of {batches} batches")
        # resumed from the newest complete checkpoint: the one said saved, or one saved
        # just before the kill that stopped the line saying so
        if i and int(resumed) not in (last_saved, last_saved + 1):
            notes.append(f"run {i} resumed from {resumed}; the newest saved was {last_saved}")
        if i and int(dropped) != lines_before - (int(resumed) + 1):
            notes.append(f"run {i} cut {dropped} result lines of {lines_before}")
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
            size = partial.stat().st_size
            if not size == int(written) < int(total):
                notes.append(f"checkpoint {k} paused at {written} of {total}: {size} on disk")
            if checkpoint_path(workdir / "checkpoints", k).exists():
                notes.append(f"checkpoint {k} complete while its write was paused")
            driver.kill()
        saved = [int(line.split()[1]) for line in driver.lines if line.startswith("saved")]
        last_saved = max([last_saved, *saved])
        printed += batch_lines(driver.lines)
        if kind != "finish":
            where = landing(workdir, driver, left_before)
            landed.append(f"{kind} {k}: {where}")
            if kind == "write" and not where.startswith("mid-write"):
                notes.append(f"a kill aimed mid-write of checkpoint {k} landed: {where}")
    if list((workdir / "checkpoints").glob(".*.partial")):
        notes.append("a partial checkpoint file is left after the finished run")
    return Resumed(results(workdir), printed, landed, notes)
