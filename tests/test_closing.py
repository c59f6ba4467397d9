"""Closing from any state: prompt, every waiter woken with a clear error, no thread left.

States tried (as a trainer with a watchdog thread would): mid-batch with another thread
blocked in ``get_batch()``, suspended with a waiter, the engine closed under the
pipeline, an env step in flight (on the env pool and inline on the loop). Also: a
blocking user node before the EpisodeRunner does not stall generation.
"""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import psutil
import pytest
from torchdata.nodes import BaseNode, Loader

from rollpipe.agent.episode import EpisodeSettings
from rollpipe.engines.records import EngineClosedError, EngineError, SamplingParams
from rollpipe.envs import FrozenLake, register
from rollpipe.nodes.episode_source import EpisodeSource
from rollpipe.nodes.rollout import EpisodeRunner, RunnerSettings
from rollpipe.pipeline import PipelineConfig, RolloutPipeline
from rollpipe.runtime import RuntimeClosedError

HANG_S = 30.0  # a deadline that only a hang reaches: promptness is checked on states


class GatedLake(FrozenLake):
    """FrozenLake whose ``step`` blocks while ``GatedLake.hold`` is set (a hung env), until
    ``release`` (or 60 s). Declared inline, as FrozenLake is (not inherited):
    ``env_workers=0`` runs it on the loop, ``env_workers > 0`` on the env pool."""

    blocking = False

    hold: ClassVar[threading.Event] = threading.Event()
    release: ClassVar[threading.Event] = threading.Event()
    entered: ClassVar[threading.Event] = threading.Event()
    blocked: ClassVar[threading.Event] = threading.Event()  # a step waits for release
    unblocked: ClassVar[threading.Event] = threading.Event()  # a blocked step went on

    def step(self, action_text: str):
        GatedLake.entered.set()
        if GatedLake.hold.is_set():
            GatedLake.blocked.set()
            GatedLake.release.wait(60)
            GatedLake.unblocked.set()
        return super().step(action_text)


register("gated_lake", GatedLake, overwrite=True)


@pytest.fixture
def gated():
    GatedLake.hold.clear()
    GatedLake.release.clear()
    GatedLake.entered.clear()
    GatedLake.blocked.clear()
    GatedLake.unblocked.clear()
    yield GatedLake
    GatedLake.release.set()


def config(**changes: Any) -> PipelineConfig:
    base = dict(
        envs="gated_lake",
        group_size=4,
        batch_size=64,
        num_groups=None,
        max_turns=3,
        max_length=512,
        concurrency=16,
        seed=5,
        sampling={"max_tokens": 16},
    )
    return PipelineConfig(**(base | changes))


class Waiter:
    """Calls ``get_batch()`` on a thread of its own and keeps what it raised."""

    def __init__(self, pipe: RolloutPipeline) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(pipe,), name="test-waiter")
        self.thread.start()

    def _run(self, pipe: RolloutPipeline) -> None:
        try:
            pipe.get_batch()
        except BaseException as e:
            self.error = e

    def woken(self, timeout: float = HANG_S) -> BaseException | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the waiting get_batch() was never woken"
        return self.error


def child_processes() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def threads_now() -> tuple[set[threading.Thread], set[int]]:
    """The baseline: this process's threads and child processes."""
    return set(threading.enumerate()), child_processes()


def assert_back_to(baseline: tuple[set[threading.Thread], set[int]], timeout: float = 5) -> None:
    """Every thread started since ``baseline`` ends (joined, not polled), and no new child
    process is left behind."""
    threads, children = baseline
    deadline = time.monotonic() + timeout
    for thread in set(threading.enumerate()) - threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in set(threading.enumerate()) - threads]
    assert left == [], f"threads left behind: {left}"
    assert child_processes() <= children, "child processes left behind"


def test_close_mid_batch_wakes_a_blocked_get_batch(vllm_engine, tokenizer, gated):
    baseline = threads_now()
    pipe = RolloutPipeline(config(batch_size=512), vllm_engine, tokenizer)
    waiter = Waiter(pipe)
    assert gated.entered.wait(30)  # episodes are stepping: the batch is filling
    pipe.close()
    error = waiter.woken()  # with an error, not the batch: close did not wait for it to fill
    assert isinstance(error, RuntimeClosedError) and "closed" in str(error)
    with pytest.raises(RuntimeClosedError, match="closed"):
        pipe.get_batch()
    assert_back_to(baseline)


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_close_while_suspended_wakes_the_waiter(vllm_engine, tokenizer, mode):
    baseline = threads_now()
    pipe = RolloutPipeline(config(envs="frozenlake", batch_size=8), vllm_engine, tokenizer)
    assert len(pipe.get_batch()) == 8
    pipe.suspend(mode, hold=True)  # held: another thread's get_batch waits for resume()
    waiter = Waiter(pipe)
    waiter.thread.join(0.2)
    assert waiter.thread.is_alive()  # held while suspended
    pipe.close()
    assert isinstance(waiter.woken(), RuntimeClosedError)  # only close could wake it
    assert not pipe.suspension.is_suspended
    assert not vllm_engine.is_paused  # close resumed the shared engine
    assert_back_to(baseline)


def test_engine_closed_while_suspended(tiny_model_path, tokenizer):
    from rollpipe.engines.hf import HFEngine

    engine = HFEngine(tiny_model_path)
    pipe = RolloutPipeline(config(envs="frozenlake", batch_size=8), engine, tokenizer)
    assert len(pipe.get_batch()) == 8
    pipe.suspend("keep", hold=True)
    waiter = Waiter(pipe)
    waiter.thread.join(0.2)
    assert waiter.thread.is_alive()
    engine.close()
    assert isinstance(waiter.woken(), EngineClosedError)
    with pytest.raises(EngineClosedError):
        pipe.resume()  # the engine cannot resume...
    assert not pipe.suspension.is_suspended  # ...but the pipeline is not left suspended
    pipe.close()  # and closing raises nothing


def test_suspend_on_a_closed_engine_raises_and_leaves_it_running(tiny_model_path, tokenizer):
    from rollpipe.engines.hf import HFEngine

    engine = HFEngine(tiny_model_path)
    pipe = RolloutPipeline(config(envs="frozenlake", batch_size=8), engine, tokenizer)
    engine.close()
    with pytest.raises(EngineClosedError):
        pipe.suspend()
    assert not pipe.suspension.is_suspended
    assert pipe.nodes.signals.is_open
    pipe.close()


def test_engine_closed_under_a_blocked_get_batch(tiny_model_path, tokenizer, gated):
    from rollpipe.engines.hf import HFEngine

    baseline = threads_now()
    engine = HFEngine(tiny_model_path)
    pipe = RolloutPipeline(config(batch_size=256), engine, tokenizer)
    waiter = Waiter(pipe)
    assert gated.entered.wait(30)  # the batch is filling
    engine.close()
    error = waiter.woken()  # the engine's own close waits for its running step
    assert isinstance(error, EngineError) and "closed" in str(error)
    pipe.close()
    assert_back_to(baseline)


@pytest.mark.parametrize("env_workers", [2, 0])
def test_close_with_an_env_step_in_flight(tiny_model_path, tokenizer, gated, env_workers):
    """A hung ``env.step`` (on the env pool, or inline on the loop) is abandoned by close,
    not awaited; its thread ends once the step returns."""
    from rollpipe.engines.hf import HFEngine

    baseline = threads_now()
    engine = HFEngine(tiny_model_path)  # its own: an inline hung step blocks its loop
    pipe = RolloutPipeline(config(env_workers=env_workers), engine, tokenizer)
    gated.hold.set()
    waiter = Waiter(pipe)
    assert gated.blocked.wait(30)  # the step is now blocked in the env
    pipe.close()
    assert not gated.unblocked.is_set(), "close waited for the hung step"
    assert isinstance(waiter.woken(), RuntimeClosedError)
    assert not gated.unblocked.is_set(), "the waiter was woken only once the step went on"
    gated.release.set()
    engine.close()
    assert_back_to(baseline)


class BlockingNode(BaseNode[Any]):
    """A user's node that passes ``first`` items through, then blocks until released."""

    def __init__(self, source: BaseNode[Any], first: int, release: threading.Event) -> None:
        super().__init__()
        self.source, self.first, self.release = source, first, release
        self.seen = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None)
        self.seen = 0

    def get_state(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def next(self) -> Any:
        if self.seen == self.first:
            self.release.wait(60)
        self.seen += 1
        return next(self.source)


def test_a_blocking_node_before_the_rollout_does_not_stall_generation(vllm_engine, tokenizer):
    release = threading.Event()
    source = BlockingNode(EpisodeSource(4, 2, seed=9), first=4, release=release)
    rollout = EpisodeRunner(
        source,
        vllm_engine,
        tokenizer,
        RunnerSettings(concurrency=8),
        EpisodeSettings(max_turns=2, sampling=SamplingParams()),
    )
    got: list[Any] = []
    loader = iter(Loader(rollout))
    consumer = threading.Thread(target=lambda: got.extend(next(loader) for _ in range(4)))
    try:
        consumer.start()
        consumer.join(60)
        # the node is blocked in its 5th next() all this time, yet the 4 admitted episodes
        # were generated to the end
        assert not consumer.is_alive() and not release.is_set()
        assert source.seen == 4
        assert sum(t.num_generated_tokens for t in got) > 0
        assert [t.episode_id for t in got] == [0, 1, 2, 3]
        release.set()
        rest = list(loader)
        assert [t.episode_id for t in rest] == [4, 5, 6, 7]
    finally:
        release.set()
        rollout.close()


def test_closing_the_root_closes_the_chain_through_user_nodes(vllm_engine, tokenizer):
    """``pipe.close()`` reaches the EpisodeRunner through nodes without a ``close()`` (a user's
    ``Mapper`` hooked in after it, Groups, Batch, Collate)."""
    from torchdata.nodes import Mapper

    baseline = threads_now()
    hooks = {"rollout": lambda node: Mapper(node, lambda traj: traj)}
    pipe = RolloutPipeline(
        config(envs="frozenlake", batch_size=8), vllm_engine, tokenizer, hooks=hooks
    )
    assert len(pipe.get_batch()) == 8
    pipe.close()
    assert pipe.nodes.rollout._closed
    with pytest.raises(RuntimeClosedError):
        next(pipe.nodes.rollout)
    assert_back_to(baseline)
