"""Closing under load, on the real vLLM engine: the engine closed mid-batch, the pipeline
closed while an env step hangs. Each surfaces an error to the waiting caller (before the
hung call returns), and every thread started ends once the hung call returns."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from faulty import FaultLake, assert_back_to, config, threads_now
from waiting import wait_until

from rollpipe.engines.records import EngineError
from rollpipe.pipeline import RolloutPipeline
from rollpipe.runtime import RuntimeClosedError

SURFACE_S = 30.0  # a deadline only a hang reaches: the waiter loops until an error
HANG_S = 60.0  # the hung step's length: no correct close waits that long


class Waiter:
    """``get_batch()`` on a thread of its own; keeps what it raised and when."""

    def __init__(self, pipe: RolloutPipeline) -> None:
        self.error: BaseException | None = None
        self.at = 0.0
        self.thread = threading.Thread(target=self._run, args=(pipe,), name="test-waiter")
        self.thread.start()

    def _run(self, pipe: RolloutPipeline) -> None:
        try:
            while True:
                pipe.get_batch()
        except BaseException as e:
            self.error, self.at = e, time.monotonic()

    def woken(self, since: float) -> tuple[BaseException | None, float]:
        self.thread.join(SURFACE_S)
        assert not self.thread.is_alive(), "the waiting get_batch() was never woken"
        return self.error, self.at - since


@pytest.fixture(autouse=True)
def _clear_log() -> Any:
    FaultLake.clear()
    yield
    FaultLake.unhang.set()


def test_engine_closed_mid_batch(tiny_model_path: Path, tokenizer: Any) -> None:
    from rollpipe.engines.vllm import VLLMEngine

    baseline = threads_now()
    engine = VLLMEngine(tiny_model_path, kv_cache_space_gib=0.25, max_model_len=1024, seed=0)
    pipe = RolloutPipeline(config(batch_size=64, concurrency=32), engine, tokenizer)
    waiter = Waiter(pipe)
    assert waiter.thread.is_alive()
    wait_until(lambda: engine.tokens_generated > 0, 120, "batches to be generated")
    start = time.monotonic()
    engine.close()
    error, took = waiter.woken(start)  # it loops on get_batch: only an error ends it
    assert isinstance(error, EngineError) and "closed" in str(error), error
    print(f"FIGURE engine_closed close_to_error_s={took:.3f}")
    pipe.close()
    assert_back_to(baseline)


@pytest.mark.parametrize("env", ["fault_lake", "inline_fault_lake"])
def test_pipeline_closed_while_a_step_hangs(env: str, vllm_engine: Any, tokenizer: Any) -> None:
    """On env threads the hang costs one thread; declared inline it blocks the loop, and
    close abandons it instead of waiting. Either way the caller is woken at once."""
    from rollpipe.engines.vllm import VLLMEngine

    baseline = threads_now()
    engine = vllm_engine
    own = env == "inline_fault_lake"  # a hang inline blocks its engine's loop: use its own
    if own:
        engine = VLLMEngine(
            vllm_engine.model_path, kv_cache_space_gib=0.25, max_model_len=1024, seed=0
        )
    pipe = RolloutPipeline(
        config(env, env_config={"fault": "hang_once", "hang_s": HANG_S}, env_timeout_s=None),
        engine,
        tokenizer,
    )
    waiter = Waiter(pipe)
    assert FaultLake.hung.wait(30)
    hang_ends = FaultLake.log[0][3] + HANG_S  # when the hung step began, plus its length
    start = time.monotonic()
    pipe.close()
    assert time.monotonic() < hang_ends, "close waited for the hung step"
    error, took = waiter.woken(start)
    assert isinstance(error, RuntimeClosedError)
    assert waiter.at < hang_ends, "the caller was woken only once the hung step returned"
    print(f"FIGURE pipeline_closed env={env} close_to_error_s={took:.3f}")
    FaultLake.unhang.set()  # the hung call returns; its thread ends
    if own:
        engine.close()
    assert_back_to(baseline)
