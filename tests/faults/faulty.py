"""Faulty environments and the checks every fault case makes.

``FaultLake`` is FrozenLake with one injected fault, chosen by config and decided from
the episode's seed and step (so a run is reproducible); every fault it injects is logged
(``FaultLake.log``) with the time it happened, so a test can match what the pipeline
reports against what was injected. By default it runs like a user env (no ``blocking``
declaration: its calls run on env threads); ``inline=True`` declares it non-blocking.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import psutil

from rollpipe.data.proto import DataProto
from rollpipe.envs import FrozenLake, register
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

FAULTS = (
    "none",
    "raise_step",  # RuntimeError on a fraction of steps
    "raise_reset",  # OSError on reset for a fraction of seeds
    "nan_reward",
    "huge_reward",  # 1e308: beyond float32
    "str_reward",  # "1.5"
    "obs_not_str",  # an int observation
    "hang_once",  # the first step of the run blocks for hang_s (released by a test)
)


def _hit(seed: int, step: int, rate: float) -> bool:
    """A reproducible coin: the same (seed, step) always lands the same way."""
    return ((seed * 2654435761 + step * 40503) % 1000) < rate * 1000


class FaultLake(FrozenLake):
    """FrozenLake with ``fault`` injected at ``rate`` (see ``FAULTS``)."""

    blocking = True  # like a user env that says nothing: its calls run on env threads
    log: ClassVar[list[tuple[str, int, int, float]]] = []  # (fault, seed, step, when)
    lock: ClassVar[threading.Lock] = threading.Lock()
    hung = threading.Event()  # set once the hang began
    unhang = threading.Event()  # set by a test to end the hang early
    hang_taken = False

    def __init__(
        self, fault: str = "none", rate: float = 0.3, hang_s: float = 5.0, **kw: Any
    ) -> None:
        super().__init__(**kw)
        assert fault in FAULTS, fault
        self.fault, self.rate, self.hang_s = fault, rate, hang_s
        self._seed0 = 0
        self._n = 0

    @classmethod
    def clear(cls) -> None:
        with cls.lock:
            cls.log = []
            cls.hang_taken = False
        cls.hung.clear()
        cls.unhang.clear()

    def _record(self, step: int) -> None:
        with FaultLake.lock:
            FaultLake.log.append((self.fault, self._seed0, step, time.monotonic()))

    def reset(self, seed: int) -> Any:
        self._seed0, self._n = seed, 0
        if self.fault == "raise_reset" and _hit(seed, 0, self.rate):
            self._record(0)
            raise OSError(f"injected reset failure (seed {seed})")
        return super().reset(seed)

    def step(self, action_text: str) -> Any:
        self._n += 1
        obs, reward, terminated, truncated, info = super().step(action_text)
        if self.fault == "hang_once":
            with FaultLake.lock:
                take = not FaultLake.hang_taken
                FaultLake.hang_taken = True
            if take:
                self._record(self._n)
                FaultLake.hung.set()
                FaultLake.unhang.wait(self.hang_s)
            return obs, reward, terminated, truncated, info
        if self.fault in ("none", "raise_reset") or not _hit(self._seed0, self._n, self.rate):
            return obs, reward, terminated, truncated, info
        self._record(self._n)
        if self.fault == "raise_step":
            raise RuntimeError(f"injected step failure (seed {self._seed0}, step {self._n})")
        if self.fault == "nan_reward":
            reward = math.nan
        elif self.fault == "huge_reward":
            reward = 1e308
        elif self.fault == "str_reward":
            reward = "1.5"  # type: ignore[assignment]
        elif self.fault == "obs_not_str":
            obs = 7  # type: ignore[assignment]
        return obs, reward, terminated, truncated, info


class InlineFaultLake(FaultLake):
    """The same faults, declared non-blocking: calls run inline on the event loop."""

    blocking = False


register("fault_lake", FaultLake, overwrite=True)
register("inline_fault_lake", InlineFaultLake, overwrite=True)


def config(env: str = "fault_lake", **changes: Any) -> PipelineConfig:
    env_config = changes.pop("env_config", {})
    base: dict[str, Any] = dict(
        envs=[{"name": env, "config": env_config}],
        group_size=2,
        batch_size=8,
        max_turns=2,
        max_length=512,
        concurrency=8,
        seed=11,
        sampling={"max_tokens": 8},
    )
    return PipelineConfig(**(base | changes))


def drain(pipe: RolloutPipeline) -> Iterator[tuple[DataProto, float]]:
    """Every batch of a finite pipeline, with the time ``get_batch`` took."""
    while True:
        start = time.monotonic()
        batch = pipe.get_batch()
        if batch is None:
            return
        yield batch, time.monotonic() - start


def identities(batch: DataProto) -> list[tuple[int, int]]:
    """(group id, episode id) of every row."""
    groups = batch.batch["traj_group_id"].tolist()
    episodes = batch.batch["traj_id"].tolist()
    return list(zip(groups, episodes, strict=True))


def check_whole_groups(rows: list[tuple[int, int]], group_size: int) -> None:
    """No row twice, and every group that appears is complete."""
    assert len(rows) == len(set(rows)), "a trajectory was yielded twice"
    per_group: dict[int, int] = {}
    for group, _ in rows:
        per_group[group] = per_group.get(group, 0) + 1
    assert set(per_group.values()) <= {group_size}, f"incomplete groups: {per_group}"


def child_processes() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def threads_now() -> tuple[set[threading.Thread], set[int]]:
    return set(threading.enumerate()), child_processes()


def assert_back_to(baseline: tuple[set[threading.Thread], set[int]], timeout: float = 5) -> None:
    """Every thread started since ``baseline`` ends (joined, not polled); no child left."""
    threads, children = baseline
    deadline = time.monotonic() + timeout
    for thread in set(threading.enumerate()) - threads:
        if thread.name != "tqdm_monitor":
            thread.join(max(0.0, deadline - time.monotonic()))
    # tqdm's monitor thread comes with a new engine's weight loading and outlives it
    left = [t.name for t in set(threading.enumerate()) - threads if t.name != "tqdm_monitor"]
    assert left == [], f"threads left behind: {left}"
    assert child_processes() <= children, "child processes left behind"
