"""``blocking = False`` is a promise of the class that makes it, not of its subclasses.

A user who subclasses ``FrozenLake`` to add logging or I/O used to inherit the grid
envs' inline execution: the subclass's ``step`` ran on the event loop driving every
episode and the engine (a 40 s step held ``get_batch`` 40 s although
``env_timeout_s=1``). Now the built-in grid envs still run inline, a subclass runs on env
threads unless it declares the promise again, and an inline call that runs long is
reported once, naming its class.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, ClassVar

import pytest

from rollpipe.envs import FrozenLake, Sokoban, is_blocking, register
from rollpipe.pipeline import PipelineConfig, RolloutPipeline


class LoggedLake(FrozenLake):
    """A user's subclass: records which thread runs each step, says nothing of blocking."""

    threads: ClassVar[set[str]] = set()

    def step(self, action_text: str) -> Any:
        LoggedLake.threads.add(threading.current_thread().name)
        return super().step(action_text)


class InlineLake(FrozenLake):
    """The same, promising again that its calls are fast."""

    blocking = False
    threads: ClassVar[set[str]] = set()

    def step(self, action_text: str) -> Any:
        InlineLake.threads.add(threading.current_thread().name)
        return super().step(action_text)


class StuckLake(FrozenLake):
    """The first step of a run blocks until the test releases it: work that cannot
    finish meanwhile (a stuck simulator, a network call that never answers)."""

    release = threading.Event()
    stuck = threading.Event()
    lock = threading.Lock()

    def step(self, action_text: str) -> Any:
        with StuckLake.lock:
            first = not StuckLake.stuck.is_set()
            StuckLake.stuck.set()
        if first:
            StuckLake.release.wait()
        return super().step(action_text)


class SlowInlineLake(FrozenLake):
    """Declares ``blocking = False`` but each step takes 0.1 s (the sleep is the work)."""

    blocking = False

    def step(self, action_text: str) -> Any:
        time.sleep(0.1)  # work, not a wait
        return super().step(action_text)


for _name, _cls in (
    ("logged_lake", LoggedLake),
    ("inline_lake", InlineLake),
    ("stuck_lake", StuckLake),
    ("slow_inline_lake", SlowInlineLake),
):
    register(_name, _cls, overwrite=True)


def config(env: str, **changes: Any) -> PipelineConfig:
    base: dict[str, Any] = dict(
        envs=env,
        group_size=2,
        batch_size=4,
        num_groups=4,
        max_turns=2,
        max_length=512,
        concurrency=8,
        seed=5,
        sampling={"max_tokens": 8},
    )
    return PipelineConfig(**(base | changes))


def drain(pipe: RolloutPipeline) -> list[Any]:
    batches = []
    while (batch := pipe.get_batch()) is not None:
        batches.append(batch)
    return batches


def test_the_promise_is_not_inherited() -> None:
    assert not is_blocking(FrozenLake())
    assert not is_blocking(Sokoban())
    assert is_blocking(LoggedLake())
    assert not is_blocking(InlineLake())

    class Twice(InlineLake):  # a subclass of a class that promised: blocking again
        pass

    assert is_blocking(Twice())


def test_grid_envs_run_inline_and_a_subclass_on_env_threads(
    vllm_engine: Any, tokenizer: Any
) -> None:
    LoggedLake.threads.clear()
    InlineLake.threads.clear()
    for env in ("logged_lake", "inline_lake"):
        with RolloutPipeline(config(env), vllm_engine, tokenizer) as pipe:
            assert len(drain(pipe)) == 2
    loop_thread = vllm_engine.runtime.thread.name  # episodes run on the engine's loop
    assert InlineLake.threads == {loop_thread}
    assert LoggedLake.threads and loop_thread not in LoggedLake.threads


def test_a_stuck_subclass_fails_its_episode_alone(vllm_engine: Any, tokenizer: Any) -> None:
    """The stuck step is on an env thread: ``env_timeout_s`` ends its episode, its group
    is replaced, and every other episode finishes while it is still stuck."""
    StuckLake.stuck.clear()
    StuckLake.release.clear()
    cfg = config("stuck_lake", env_timeout_s=5.0)  # the stuck step never returns
    try:
        with RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe:
            batches = drain(pipe)
            assert StuckLake.stuck.is_set() and not StuckLake.release.is_set()  # still stuck
            assert pipe.nodes.groups.total_drops["errored_trajectories"] == 1
    finally:
        StuckLake.release.set()
    assert sum(len(b) for b in batches) == 4 * cfg.group_size  # the group was replaced
    errors = [e for b in batches for e in b.meta_info["env_errors"]]
    assert len(errors) == 1, errors
    assert "StuckLake.step" in errors[0]["message"]
    assert "env_timeout_s=5.0" in errors[0]["message"]


def test_a_slow_inline_call_is_reported_once_naming_the_class(
    vllm_engine: Any, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config("slow_inline_lake", num_groups=2, env_timeout_s=None)
    with (
        caplog.at_level(logging.WARNING, logger="rollpipe.agent.episode"),
        RolloutPipeline(cfg, vllm_engine, tokenizer) as pipe,
    ):
        drain(pipe)
    reports = [r.getMessage() for r in caplog.records if "inline" in r.getMessage()]
    assert len(reports) == 1, reports  # several slow steps, one report
    assert "SlowInlineLake" in reports[0] and "declares blocking = False" in reports[0]
