"""A weight sync that never finishes fails in time, naming the engine and the version,
and leaves the engine dead so that no later call hangs either (Ray actor here; the vLLM
server case is in ``tests/distributed/test_engine_server.py``, which shares its server).

A hung weight sync with no error is the most reported rollout bug in the peers' trackers;
before, ``RayEngine.update_weights`` waited for ever on an actor that never answered.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpipe.engines import EngineError, SamplingParams
from rollpipe.engines.ray_engine import RayEngine

ray = pytest.importorskip("ray")  # the dev extra installs it: CI always runs these

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # the actors cannot import this test module: ship its functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=100 << 20,
    )
    yield
    ray.shutdown()


def stalling_engine(path: str) -> Any:
    """An HFEngine whose ``update_weights`` never returns (a stuck NCCL group, a hung
    load): defined here so that Ray pickles it by value into the actor."""
    from rollpipe.engines.hf import HFEngine

    class StallingEngine(HFEngine):
        def update_weights(self, weights: Any, version: int | None = None) -> int:
            threading.Event().wait()  # never set: work that cannot finish
            raise AssertionError("unreachable")

    return StallingEngine(path)


def test_a_stalled_ray_weight_sync_fails_in_time_and_kills_the_engine(
    cluster: None, tiny_model_path: Path
) -> None:
    path = str(tiny_model_path)
    engine = RayEngine(lambda: stalling_engine(path), num_cpus=1, update_weights_timeout_s=2)
    try:
        assert engine.generate_batch([[5, 6, 7]], GREEDY)[0].finish_reason in ("stop", "length")
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(path).state_dict()
        start = time.monotonic()
        with pytest.raises(EngineError) as caught:
            engine.update_weights(weights)
        took = time.monotonic() - start
        message = str(caught.value)
        assert "RayEngine" in message and "EngineHost" in message  # which engine
        assert "update_weights to version 1" in message  # which version
        assert "update_weights_timeout_s=2" in message  # which limit, and what to do
        assert took < 60, f"the limit of 2 s was not kept ({took:.1f} s)"
        assert not engine.alive and engine.version == 0
        start = time.monotonic()
        with pytest.raises(EngineError, match="died"):
            engine.generate_batch([[5, 6, 7]], GREEDY)
        with pytest.raises(EngineError, match="died"):
            engine.update_weights(weights)
        assert time.monotonic() - start < 10  # failed at once, not after another limit
    finally:
        engine.close()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "60", True])
def test_the_limit_is_checked_before_an_actor_starts(bad: Any) -> None:
    with pytest.raises(ValueError, match="update_weights_timeout_s") as caught:
        RayEngine(lambda: None, update_weights_timeout_s=bad)  # type: ignore[arg-type, return-value]
    assert repr(bad) in str(caught.value)


@pytest.mark.parametrize("bad", [0, -2.5, float("nan"), "600"])
def test_the_server_limit_is_checked_before_connecting(bad: Any) -> None:
    from rollpipe.engines.server import ServerEngine

    with pytest.raises(ValueError, match="ServerEngine: update_weights_timeout_s") as caught:
        ServerEngine("http://127.0.0.1:9", update_weights_timeout_s=bad)
    assert repr(bad) in str(caught.value)
