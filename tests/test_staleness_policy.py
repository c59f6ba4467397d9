"""``max_off_policy_strategy``: ``drop`` stale groups (ROLL's, the default) or ``wait``.

The workload makes staleness happen without timing: groups 0 and 1 start at version 0,
generate one turn, then their env blocks until the eight episodes of groups 2..5 have
ended (so they are still in flight across weight updates); everything else is one turn.
With ``async_generation_ratio=1`` and first finishers filling batches (``in_order=False``),
``drop`` fills batch 1 with groups 4 and 5, and groups 0 and 1, finished after the next
update, are two versions old and dropped. ``wait`` makes batch 1 wait for them (they would
be too old after one more update) and take them first: no group is stale or dropped.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.nodes import IterableWrapper

from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.records import Group
from rollpipe.data.proto import DataProto
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs import register
from rollpipe.nodes.batch import Batch
from rollpipe.nodes.signals import PipelineSignals
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

from records import make_trajectory

ENV, SEED, SLOW_GROUPS, FAST_EPISODES = "test_held_back", 5, (0, 1), 8
HOLD_LIMIT_S = 120.0  # only a guard against a hang: an env that waits this long errors


class Gate:
    """Holds the slow episodes' first step until released: by ``release()``, or once
    ``after_fast`` fast episodes have ended (None: only by ``release()``)."""

    def __init__(self, after_fast: int | None) -> None:
        self.after_fast, self.released = after_fast, False
        self.fast_done = self.slow_done = 0
        self.cond = threading.Condition()

    def _open(self) -> bool:
        return self.released or (self.after_fast is not None and self.fast_done >= self.after_fast)

    def ended(self, slow: bool) -> None:
        with self.cond:
            if slow:
                self.slow_done += 1
            else:
                self.fast_done += 1
            self.cond.notify_all()

    def release(self) -> None:
        with self.cond:
            self.released = True
            self.cond.notify_all()

    def wait(self, until: Any) -> None:
        with self.cond:
            if not self.cond.wait_for(until, timeout=HOLD_LIMIT_S):
                raise RuntimeError(f"gate: gave up waiting ({vars(self)})")


GATE = Gate(FAST_EPISODES)


class HeldBack:
    """Groups ``SLOW_GROUPS``: three turns, the first step held by ``GATE``. Every other
    group: one turn."""

    def __init__(self) -> None:
        self.turn, self.slow = 0, False

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        self.slow = seed in {derive_seed(SEED, g) for g in SLOW_GROUPS}
        return "Say something.", {}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        if self.slow and self.turn == 1:
            GATE.wait(GATE._open)
        done = self.turn >= (3 if self.slow else 1)
        if done:
            GATE.ended(self.slow)
        return "Go on.", 1.0, done, False, {}

    def close(self) -> None:
        pass


register(ENV, HeldBack, overwrite=True)


@pytest.fixture
def engine(tokenizer):
    reply = [*tokenizer.encode("ok"), tokenizer.eos_token_id]
    global GATE
    GATE = Gate(FAST_EPISODES)
    with ScriptedEngine(lambda prompt, params: reply) as engine:
        yield engine


def config(strategy: str) -> PipelineConfig:
    return PipelineConfig(
        envs=ENV,
        group_size=2,
        batch_size=4,
        max_turns=3,
        max_length=256,
        concurrency=16,
        in_order=False,  # first finishers fill the batch
        seed=SEED,
        async_generation_ratio=1,
        max_off_policy_strategy=strategy,
        sampling={"max_tokens": 4},
    )


def group_ids(batch: DataProto) -> set[int]:
    return {int(str(uid).rpartition("/g")[2]) for uid in batch.non_tensor_batch["uid"]}


def staleness(batch: DataProto, version: int) -> int:
    """How many versions the batch's oldest response token is behind ``version``."""
    mask = batch.batch["response_mask"].bool()
    return version - int(batch.batch["policy_versions"][mask].min())


def train(pipe: RolloutPipeline, steps: range, after_update: Any = None) -> list[dict[str, Any]]:
    """ROLL's loop: get_batch, then suspend and update the weights (a new version);
    ``after_update(pipe, version)`` runs after each update."""
    seen = []
    for step in steps:
        batch = pipe.get_batch(DataProto(meta_info={"global_step": step}), 4)
        assert batch is not None and len(batch) == 4
        metrics = batch.meta_info["metrics"]
        seen.append(
            {
                "groups": group_ids(batch),
                "staleness": staleness(batch, pipe.version),
                "stale": metrics.get("dropped/stale", 0),
                "wasted": metrics.get("dropped/wasted_tokens", 0),
            }
        )
        pipe.suspend()
        version = pipe.update_weights({"w": torch.zeros(1)})
        if after_update is not None:
            after_update(pipe, version)
    return seen


def test_drop_drops_the_groups_that_finished_too_old(engine, tokenizer):
    GATE.after_fast = None  # the slow groups end only after the update to version 2

    def after_update(pipe: RolloutPipeline, version: int) -> None:
        if version == 2:
            GATE.release()
            pipe.resume()  # the slow episodes' last turns run now, before the next grant
            GATE.wait(lambda: GATE.slow_done == 4)

    with RolloutPipeline(config("drop"), engine, tokenizer) as pipe:
        seen = train(pipe, range(4), after_update)
    assert seen[1]["groups"] == {4, 5}  # batch 1 did not wait for groups 0 and 1
    assert all(s["staleness"] <= 1 for s in seen)  # what is kept is within the bound
    assert sum(s["stale"] for s in seen) == 2  # groups 0 and 1, two versions old
    assert sum(s["wasted"] for s in seen) > 0
    assert not {0, 1} & set().union(*(s["groups"] for s in seen))


def test_wait_keeps_every_group_within_the_bound_and_drops_none(engine, tokenizer):
    with RolloutPipeline(config("wait"), engine, tokenizer) as pipe:
        seen = train(pipe, range(5))
        assert pipe.nodes.groups.total_drops["stale"] == 0
        started = set(range(pipe.nodes.source._group))
        live = set(pipe.nodes.signals.started_versions())
    assert all(s["staleness"] <= 1 for s in seen)
    assert sum(s["stale"] for s in seen) == 0 and sum(s["wasted"] for s in seen) == 0
    assert seen[1]["groups"] == {0, 1}  # batch 1 waited for the oldest groups
    batched = [g for s in seen for g in s["groups"]]
    assert len(batched) == len(set(batched)) == 10  # none twice
    assert started == set(batched) | live and not live & set(batched)  # none lost


def test_a_checkpoint_while_waiting_keeps_the_ledger_and_the_carried_groups(engine, tokenizer):
    with RolloutPipeline(config("wait"), engine, tokenizer) as pipe:
        first = train(pipe, range(2))
        state = pipe.state_dict()
        live = pipe.nodes.signals.started_versions()
    assert first[1]["groups"] == {0, 1}
    assert {4, 5} <= set(live)  # carried in the Batch, not yet trained on: still live
    assert all(v >= 0 for v in live.values())
    with RolloutPipeline(config("wait"), engine, tokenizer) as resumed:
        resumed.load_state_dict(state)
        assert resumed.nodes.signals.started_versions() == live
        rest = train(resumed, range(2, 5))
        started = set(range(resumed.nodes.source._group))
        live = set(resumed.nodes.signals.started_versions())
        assert resumed.nodes.signals.get_state()["started"] == sorted(
            [g, v] for g, v in resumed.nodes.signals.started_versions().items()
        )
    assert rest[0]["groups"] == {4, 5}  # the carried groups come first, none lost
    assert all(s["staleness"] <= 1 and s["stale"] == 0 for s in rest)
    batched = [g for s in [*first, *rest] for g in s["groups"]]
    assert len(batched) == len(set(batched)) == 10  # none twice
    assert started == set(batched) | live and not live & set(batched)  # none lost


# -- the Batch stage alone: any finishing order, AReaL's admission, one update a batch --


class Clock:
    step = version = 0


def finishing(order: list[int], signals: Any, clock: Clock, ratio: int, per_batch: int) -> Any:
    """Groups of two, started as the grants allow (``(step + 1 + ratio) * per_batch``,
    each recorded at the version it starts at), finishing in the ``order`` drawn: each
    pull finishes the live group ``order[i] % len(live)``, all its tokens at its start
    version (the oldest they can be)."""
    started, live = 0, []
    for choice in order:
        while started < (clock.step + 1 + ratio) * per_batch:
            signals.note_started(started, clock.version)
            live.append((started, clock.version))
            started += 1
        gid, version = live.pop(choice % len(live))
        members = tuple(make_trajectory(gid, 2 * gid + i, version=version) for i in (0, 1))
        yield Group(gid, members)


@settings(max_examples=150, deadline=None)
@given(
    ratio=st.integers(0, 3),
    per_batch=st.integers(1, 3),
    order=st.lists(st.integers(0, 50), min_size=40, max_size=80),
)
def test_waiting_batches_hold_no_group_older_than_the_bound(ratio, per_batch, order):
    signals, clock = PipelineSignals(), Clock()
    batches = Batch(
        IterableWrapper(finishing(order, signals, clock, ratio, per_batch)),
        2 * per_batch,
        max_staleness=ratio,
        current_version=lambda: clock.version,
        signals=signals,
        wait=True,
    )
    batches.reset()
    seen: list[int] = []
    for step in range(6):
        clock.step = step
        try:
            batch = next(batches)
        except StopIteration:
            break
        ages = [clock.version - g.min_version for g in batch.groups]
        assert max(ages) <= ratio and "stale" not in batch.drops
        seen += [g.group_id for g in batch.groups]
        assert not set(signals.started_versions()) & set(seen)  # consumed: off the ledger
        clock.version += 1  # the trainer's update
    assert len(seen) == len(set(seen))  # none twice
