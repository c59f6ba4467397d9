"""EngineState: the state and rules shared by BaseEngine and EnginePool, alone and as the
real engines apply them (the same sequence of calls gives the same state and errors)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.engines.hf import HFEngine
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.records import EngineClosedError, EngineError
from rollpipe.engines.state import (
    EngineState,
    EngineStateView,
    check_new_version,
    check_pause_mode,
)

# -- the state alone ---------------------------------------------------------------------


def test_a_new_state_runs_at_its_version() -> None:
    state = EngineState("MyEngine", version=3)
    assert (state.version, state.pause_mode, state.interruptions) == (3, None, 0)
    assert not state.closed and state.dead is None
    state.check_open()
    with pytest.raises(ValueError, match="MyEngine: version must be an int >= 0, got -1"):
        EngineState("MyEngine", version=-1)


def test_pause_resume_and_update_count_interruptions() -> None:
    state = EngineState("MyEngine")
    with state.pausing("keep"):
        assert state.pause_mode == "keep"  # set before the owner pauses its backend
    with state.pausing("wait"):  # a pause while paused changes the mode
        pass
    with state.updating(None) as new_version:
        assert new_version == 1 and state.version == 0  # stored once the load returns
    assert state.version == 1
    with state.updating(7) as new_version:
        assert new_version == 7
    with state.resuming():
        assert state.pause_mode is None  # cleared before the owner resumes its backend
    assert (state.version, state.pause_mode, state.interruptions) == (7, None, 5)


def test_a_failed_transition_keeps_the_old_mode_and_version() -> None:
    state = EngineState("MyEngine", version=2)
    with state.pausing("abort"):
        pass
    with pytest.raises(OSError), state.pausing("keep"):
        raise OSError("backend")
    assert state.pause_mode == "abort"  # the previous mode came back
    with pytest.raises(OSError), state.updating(None):
        raise OSError("load")
    assert state.version == 2
    assert state.interruptions == 3  # attempts count: each may have held requests
    with pytest.raises(OSError), state.resuming():
        raise OSError("resume")
    assert state.pause_mode is None  # a failed resume does not pause again


def test_bad_arguments_fail_before_anything_changes() -> None:
    state = EngineState("MyEngine")
    with pytest.raises(ValueError, match=r"pause mode must be one of \('keep', 'abort', 'wait'\)"):
        check_pause_mode("sleep")
    with pytest.raises(ValueError, match="pause mode"), state.pausing("sleep"):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="update_weights: version must be an int >= 0"):
        check_new_version(-1)
    with pytest.raises(ValueError, match="update_weights: version"), state.updating(True):
        pass
    assert (state.version, state.pause_mode, state.interruptions) == (0, None, 0)


def test_one_transition_at_a_time() -> None:
    state = EngineState("MyEngine")
    with state.pausing("keep"):
        with pytest.raises(RuntimeError, match="one at a time"), state.updating(None):
            pass
        with pytest.raises(RuntimeError, match="one at a time"), state.resuming():
            pass
    assert (state.version, state.pause_mode, state.interruptions) == (0, "keep", 1)
    with state.resuming():  # free again once the first one ended
        pass


def test_closed_and_dead_fail_check_open_naming_the_owner() -> None:
    state = EngineState("EnginePool", noun="pool")
    first, second = OSError("first"), OSError("second")
    state.mark_dead(first)
    state.mark_dead(second)
    assert state.dead is first
    with pytest.raises(
        EngineError, match=r"EnginePool died \(OSError\('first'\)\); create a new pool"
    ) as info:
        state.check_open()
    assert info.value.__cause__ is first and not isinstance(info.value, EngineClosedError)
    assert state.close() and not state.close()  # the first call closes (and tears down)
    with pytest.raises(
        EngineClosedError, match="EnginePool is closed; create a new pool to generate"
    ):
        state.check_open()


def test_the_view_reads_the_state() -> None:
    class Owner(EngineStateView):
        def __init__(self) -> None:
            self._state = EngineState("Owner", version=1)

    owner = Owner()
    assert (owner.version, owner.is_paused, owner.pause_mode, owner.alive) == (1, False, None, True)
    with owner._state.pausing("wait"):
        pass
    assert owner.is_paused and owner.pause_mode == "wait" and owner.interruptions == 1
    owner._state.mark_dead(OSError("gone"))
    assert not owner.alive and not owner.closed
    owner._state.close()
    assert owner.closed and not owner.alive


# -- the real engines against the bare state ---------------------------------------------

Op = tuple[str, Any]
OPS = st.one_of(
    st.tuples(st.just("pause"), st.sampled_from(["keep", "abort", "wait", "sleep"])),
    st.tuples(st.just("resume"), st.none()),
    st.tuples(st.just("update"), st.none() | st.integers(-1, 9)),
)


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except (ValueError, EngineError) as e:
        return type(e).__name__, str(e)


def _apply(engine: Any, op: Op, weights: dict[str, torch.Tensor]) -> tuple[str, Any]:
    name, arg = op
    if name == "pause":
        return _outcome(lambda: engine.pause(arg))
    if name == "resume":
        return _outcome(engine.resume)
    if name == "update":
        return _outcome(lambda: engine.update_weights(weights, version=arg))
    return _outcome(engine.close)


def _apply_to_state(state: EngineState, op: Op) -> tuple[str, Any]:
    """What an owner does: check the arguments, check it is open, run the transition."""
    name, arg = op

    def pause() -> None:
        check_pause_mode(arg)
        state.check_open()
        with state.pausing(arg):
            pass

    def resume() -> None:
        state.check_open()
        with state.resuming():
            pass

    def update() -> int:
        check_new_version(arg)
        state.check_open()
        with state.updating(arg):
            pass
        return state.version

    def close() -> None:
        state.close()

    return _outcome({"pause": pause, "resume": resume, "update": update, "close": close}[name])


def _observed(thing: Any, offset: int = 0) -> tuple[int, Any, int, bool]:
    return (thing.version, thing.pause_mode, thing.interruptions - offset, thing.closed)


class Slot:
    """One engine of a kind, rebuilt only after an example closed it."""

    def __init__(self, build: Any) -> None:
        self.build = build
        self.engine = build()

    def ready(self) -> Any:
        if self.engine.closed:
            self.engine = self.build()
        elif self.engine.is_paused:
            self.engine.resume()
        return self.engine


@pytest.fixture(scope="module")
def weights(tiny_model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module", params=["HFEngine", "EnginePool"])
def slot(request: pytest.FixtureRequest, tiny_model_path: Path) -> Iterator[tuple[Slot, str]]:
    if request.param == "HFEngine":
        built = Slot(lambda: HFEngine(tiny_model_path))
        noun = "engine"
    else:
        built = Slot(lambda: EnginePool(lambda rank: HFEngine(tiny_model_path), 2))
        noun = "pool"
    yield built, noun
    built.engine.close()


@settings(max_examples=30, deadline=None)
@given(
    ops=st.lists(OPS, max_size=8),
    closes=st.integers(0, 4).map(lambda n: n == 0),  # a close costs a rebuild: 1 in 5
    after=st.lists(OPS, max_size=3),
)
def test_an_engine_and_the_bare_state_agree(
    slot: tuple[Slot, str],
    weights: dict[str, torch.Tensor],
    ops: list[Op],
    closes: bool,
    after: list[Op],
) -> None:
    holder, noun = slot
    engine = holder.ready()
    state = EngineState(type(engine).__name__, version=engine.version, noun=noun)
    offset = engine.interruptions
    sequence = ops + ([("close", None), *after, ("close", None)] if closes else [])
    for op in sequence:
        assert _apply(engine, op, weights) == _apply_to_state(state, op), op
        assert _observed(engine, offset) == _observed(state), op
    assert engine.alive == (not state.closed)
