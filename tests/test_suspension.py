"""One Suspension owns a pipeline's suspension; its rules, exactly (docs/pausing.md).

* ``get_batch`` resumes a ``suspend()`` whatever thread asks (ROLL's loop across a Ray
  actor's threads); a held suspension (``hold=True``, ``with suspended():``) makes it wait,
  says why in a log line, and raises at once on the holding thread or when closed.
* A second ``suspend`` with another mode raises; the same mode is a no-op.
* After ``close()``, ``suspend`` / ``resume`` / ``update_weights`` raise and leave the
  engine alone.
* ``async_generation_ratio=0``: an update made while ``get_batch`` waits drops the groups
  it made stale, so the batch holds only tokens of the weights current at its return.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.nodes import IterableWrapper, Mapper
from waiting import wait_until

from rollpipe.agent.records import Group
from rollpipe.data.proto import DataProto
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.protocol import Engine
from rollpipe.nodes.batch import Batch
from rollpipe.nodes.signals import PipelineSignals
from rollpipe.nodes.suspension import Suspension
from rollpipe.pipeline import PipelineConfig, RolloutPipeline
from rollpipe.runtime import Runtime, RuntimeClosedError

from records import make_trajectory

DEADLINE_S = 120  # only a hang reaches it


def config(**changes: Any) -> PipelineConfig:
    base: dict[str, Any] = dict(
        envs="frozenlake",
        group_size=2,
        batch_size=4,
        max_turns=2,
        max_length=512,
        concurrency=8,
        seed=7,
        sampling={"max_tokens": 12},
    )
    return PipelineConfig(**(base | changes))


def response_versions(batch: DataProto) -> set[int]:
    mask = batch.batch["response_mask"].bool()
    return set(batch.batch["policy_versions"][mask].unique().tolist())


class Worker:
    """``fn()`` on a thread of its own; ``result()`` joins it and returns or re-raises."""

    def __init__(self, fn: Callable[[], Any], name: str = "test-worker") -> None:
        self.out: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.out["value"] = fn()
        except BaseException as e:
            self.out["error"] = e

    def result(self) -> Any:
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "the call never returned"
        if "error" in self.out:
            raise self.out["error"]
        return self.out["value"]


class FakeEngine:
    """Records pause / resume / update calls; a runtime for the suspension's waits."""

    def __init__(self) -> None:
        self.runtime = Runtime("fake-engine")
        self.calls: list[tuple[str, ...]] = []
        self.version = 0
        self.is_paused = False

    def pause(self, mode: str) -> None:
        assert not self.is_paused, "paused twice"
        self.calls.append(("pause", mode))
        self.is_paused = True

    def resume(self) -> None:
        self.calls.append(("resume",))
        self.is_paused = False

    def update_weights(self, weights: Any, version: int | None = None) -> int:
        self.calls.append(("update",))
        self.version += 1
        return self.version


@pytest.fixture
def fake() -> Any:
    engine = FakeEngine()
    yield engine
    engine.runtime.close()


# -- the rules, on a fake engine ------------------------------------------------------------
def test_one_default_mode_everywhere_is_rolls_abort() -> None:
    for fn in (
        Suspension.suspend,
        Suspension.suspended,
        RolloutPipeline.suspend,
        RolloutPipeline.suspended,
        Engine.pause,
        BaseEngine.pause,
        EnginePool.pause,
    ):
        assert inspect.signature(fn).parameters["mode"].default == "abort", fn


def test_a_suspend_is_resumed_by_the_next_batch_from_any_thread(fake: FakeEngine) -> None:
    s = Suspension(fake, name="pipe-a")  # type: ignore[arg-type]
    s.suspend()
    assert (s.state, s.mode, s.held, s.asked_by) == ("suspended", "abort", False, "MainThread")
    assert not s.admitting
    Worker(s.enter_batch, name="other").result()  # ROLL's get_batch, on another thread
    assert s.state == "running" and s.admitting and not fake.is_paused
    assert fake.calls == [("pause", "abort"), ("resume",)]


def test_a_held_suspension_holds_says_why_and_raises_on_its_own_thread(
    fake: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    s = Suspension(fake, name="pipe-b", log_after_s=0.01)  # type: ignore[arg-type]
    s.suspend("keep", hold=True)
    with pytest.raises(RuntimeError, match="this thread holds the suspension"):
        s.enter_batch()  # it would wait for a resume() only this thread can make
    caplog.set_level(logging.WARNING, logger="rollpipe.nodes.suspension")
    waiter = Worker(s.enter_batch)
    message = wait_until(
        lambda: next((r.getMessage() for r in caplog.records if "waiting" in r.getMessage()), ""),
        DEADLINE_S,
        "the waiting get_batch's log line",
    )
    assert "get_batch is waiting: pipe-b is suspended and held (mode 'keep')" in message
    assert "thread 'MainThread'" in message and "call resume()" in message
    assert waiter.thread.is_alive() and s.held
    s.resume()
    waiter.result()
    assert s.state == "running"


def test_close_wakes_a_held_wait_with_the_reason(fake: FakeEngine) -> None:
    s = Suspension(fake, name="pipe-c", log_after_s=0.01)  # type: ignore[arg-type]
    with s.suspended("wait"):
        waiter = Worker(s.enter_batch)
        s.close("close() from the test")
        with pytest.raises(RuntimeClosedError, match=r"pipe-c.*close\(\) from the test"):
            waiter.result()
    assert fake.calls == [("pause", "wait"), ("resume",)]  # close resumed; the block did not


def test_a_second_suspend_with_another_mode_raises_the_same_is_a_no_op(fake: FakeEngine) -> None:
    s = Suspension(fake, name="pipe-d")  # type: ignore[arg-type]
    Worker(lambda: s.suspend("keep"), name="trainer").result()
    s.suspend("keep")  # the same mode: nothing changes
    with pytest.raises(ValueError) as info:
        s.suspend("abort")
    text = str(info.value)
    assert "suspend('abort')" in text and "mode 'keep'" in text
    assert "thread 'trainer'" in text and "resume() first" in text
    assert fake.calls == [("pause", "keep")] and s.mode == "keep" and not s.held
    s.suspend("keep", hold=True)  # the same mode, held now
    assert s.held and s.asked_by == "MainThread"
    s.resume()
    assert fake.calls == [("pause", "keep"), ("resume",)]


def test_after_close_control_raises_and_leaves_the_engine_alone(fake: FakeEngine) -> None:
    s = Suspension(fake, name="pipe-e")  # type: ignore[arg-type]
    s.close("closed by the test")
    for call in (s.suspend, s.resume, lambda: s.update_weights({})):
        with pytest.raises(RuntimeClosedError, match="pipe-e, which is closed"):
            call()
    assert fake.calls == [] and s.state == "closed"


def test_admission_is_the_suspensions_and_its_changes_reach_listeners() -> None:
    signals = PipelineSignals()  # a suspension of its own, without an engine
    heard: list[bool] = []
    signals.add_listener(lambda: heard.append(signals.is_open))
    signals.suspension.suspend()
    signals.suspension.resume()
    assert heard == [False, True]


# -- the Batch stage: size per request, staleness at completion ------------------------------
def group(group_id: int, version: int) -> Group:
    members = [make_trajectory(group_id, 2 * group_id + m, version=version) for m in (0, 1)]
    return Group(group_id, tuple(members))


def test_batch_takes_its_size_per_request_once() -> None:
    batch = Batch(IterableWrapper([group(g, 0) for g in range(6)]), 2)
    batch.reset()
    batch.request(4)
    assert len(next(batch)) == 4
    assert len(next(batch)) == 2  # back to num_trajectories
    with pytest.raises(ValueError, match="num_trajectories"):
        batch.request(0)


def test_batch_drops_groups_that_went_stale_while_they_waited() -> None:
    version = [0]
    signals = PipelineSignals()

    def arrive(g: Group) -> Group:
        if g.group_id == 1:
            version[0] = 1  # an update lands after group 0 was accepted
        return g

    groups = [group(0, 0), group(1, 1), group(2, 1)]
    batch = Batch(
        Mapper(IterableWrapper(groups), arrive),
        4,
        max_staleness=0,
        current_version=lambda: version[0],
        signals=signals,
    )
    batch.reset()
    out = next(batch)
    assert [g.group_id for g in out.groups] == [1, 2]
    assert out.drops["stale"] == 1 and out.drops["wasted_tokens"] == 6  # 2 x 3 tokens
    assert signals.replacements_pending == 1  # replaced, not lost


def test_the_pipeline_sets_no_node_attribute() -> None:
    import rollpipe.pipeline

    source = inspect.getsource(rollpipe.pipeline)
    assert not re.findall(r"self\.nodes\.\w+\.\w+\s*=[^=]", source)


# -- the pipeline, on the real engine -------------------------------------------------------
def test_rolls_loop_across_threads_resumes(vllm_engine: Any, tokenizer: Any) -> None:
    """suspend on one thread, get_batch on another: it resumes (a Ray actor's calls)."""
    with RolloutPipeline(config(), vllm_engine, tokenizer) as pipe:
        Worker(pipe.suspend, name="actor-thread-1").result()
        assert pipe.suspension.asked_by == "actor-thread-1"
        batch = Worker(lambda: pipe.get_batch(DataProto(meta_info={"global_step": 0}), 4)).result()
        assert batch is not None and len(batch) == 4 and not pipe.suspension.is_suspended


def test_closed_pipeline_control_never_touches_the_engine(vllm_engine: Any, tokenizer: Any) -> None:
    pipe = RolloutPipeline(config(), vllm_engine, tokenizer, name="closed-pipe")
    pipe.close()
    before = (vllm_engine.interruptions, vllm_engine.version, vllm_engine.is_paused)
    for call in (pipe.suspend, pipe.resume, lambda: pipe.update_weights({})):
        with pytest.raises(RuntimeClosedError, match="closed-pipe"):
            call()
    with pytest.raises(RuntimeClosedError, match="closed-pipe"):
        pipe.get_batch()
    assert (vllm_engine.interruptions, vllm_engine.version, vllm_engine.is_paused) == before


@pytest.fixture(scope="module")
def weights(tiny_model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_an_update_while_get_batch_waits_leaves_no_old_row(
    vllm_engine: Any, tokenizer: Any, weights: dict[str, torch.Tensor]
) -> None:
    """Another thread updates the weights once per get_batch, just after its first group
    was accepted (the group waits in the Batch stage): that group, and any other made
    stale, is dropped and replaced; every row carries the version current at return."""
    asked, done = threading.Event(), threading.Event()
    stop = threading.Event()
    update_now = [False]

    def first_group_triggers_an_update(g: Group) -> Group:
        if update_now[0]:
            update_now[0] = False
            asked.set()
            assert done.wait(DEADLINE_S)  # the update lands while this get_batch waits
            done.clear()
        return g

    def updater() -> None:
        while asked.wait(DEADLINE_S) and not stop.is_set():
            asked.clear()
            pipe.update_weights(weights)
            done.set()

    hooks = {"groups": lambda node: Mapper(node, first_group_triggers_an_update)}
    pipe = RolloutPipeline(config(batch_size=8), vllm_engine, tokenizer, hooks=hooks)
    thread = threading.Thread(target=updater, name="updater", daemon=True)
    thread.start()
    try:
        for step in range(3):
            before = pipe.version
            update_now[0] = True
            batch = pipe.get_batch(DataProto(meta_info={"global_step": step}), 8)
            assert batch is not None and len(batch) == 8
            assert pipe.version == before + 1  # the update landed during this get_batch
            assert response_versions(batch) == {pipe.version}
            assert batch.meta_info["metrics"]["dropped/stale"] >= 1
    finally:
        stop.set()
        asked.set()
        thread.join(DEADLINE_S)
        pipe.close()


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("suspend"), st.sampled_from(["keep", "abort", "wait"]), st.booleans()),
        st.just(("resume",)),
        st.just(("update",)),
    ),
    min_size=1,
    max_size=5,
)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS)
def test_control_from_a_second_thread_loses_duplicates_and_mixes_nothing(
    ops: list[tuple[Any, ...]],
    vllm_engine: Any,
    tokenizer: Any,
    weights: dict[str, torch.Tensor],
) -> None:
    """One thread asks for batches while another runs ``ops``: every batch is whole, no
    trajectory comes twice, and each batch is generated by one version (ratio 0)."""
    pipe = RolloutPipeline(config(), vllm_engine, tokenizer)

    def signals() -> None:
        try:
            for op in ops:
                if op[0] == "suspend":
                    try:
                        pipe.suspend(op[1], hold=op[2])
                    except ValueError as e:  # suspended in another mode already
                        assert "resume() first" in str(e)
                elif op[0] == "resume":
                    pipe.resume()
                else:
                    pipe.update_weights(weights)
        finally:
            pipe.resume()  # a hold left behind would hold the collector forever

    try:
        collector = Worker(lambda: [pipe.get_batch() for _ in range(2)], name="collector")
        Worker(signals, name="signals").result()
        batches = collector.result()
    finally:
        pipe.close()
    uids = [u for b in batches for u in b.non_tensor_batch["traj_uid"]]
    assert len(uids) == len(set(uids)) == 8
    for b in batches:
        assert len(response_versions(b)) == 1


def test_an_engine_factory_and_a_tokenizer_path(tiny_model_path: Path) -> None:
    from rollpipe.engines.hf import HFEngine

    make = functools.partial(HFEngine, tiny_model_path)
    with RolloutPipeline(config(), make, str(tiny_model_path)) as pipe:
        assert isinstance(pipe.engine, HFEngine) and pipe.owns_engine
        assert pipe.tokenizer.pad_token_id is not None or pipe.tokenizer.eos_token_id is not None
        assert len(pipe.get_batch()) == 4
    assert pipe.engine.closed  # the pipeline owned the engine it made
    with pytest.raises(TypeError, match="not an Engine"):
        RolloutPipeline(config(), lambda: "no engine", str(tiny_model_path))
