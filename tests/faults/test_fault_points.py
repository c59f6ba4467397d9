"""Suspend / resume / update_weights / checkpoint at random points, on the real vLLM engine.

Hypothesis draws, for each of ``BATCHES`` batches, what happens while it is collected:
nothing; a suspend (keep, abort or wait) from another thread after a random delay —
with or without a weight update — then a resume; or a checkpoint before it, restored
into a fresh pipeline. Whatever the points, the stream must yield exactly the
trajectories an uninterrupted run yields, in the same order (admission order, no
staleness bound, and updates that load the same weights): nothing lost, nothing
duplicated. ``EXAMPLES * BATCHES`` points run in CI (``nox -s soak`` runs many more).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from faulty import assert_back_to, config, identities, threads_now
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpipe.pipeline import PipelineConfig, RolloutPipeline

BATCHES = 4
EXAMPLES = 55  # 220 points
CONFIG: PipelineConfig = config(
    "frozenlake", env_config={}, batch_size=4, async_generation_ratio=None, concurrency=8
)

POINT = st.one_of(
    st.just(("plain",)),
    st.tuples(
        st.just("suspend"),
        st.sampled_from(["keep", "abort", "wait"]),
        st.floats(0.0, 0.08),
        st.booleans(),
    ),
    st.just(("checkpoint",)),
)


@pytest.fixture(scope="module")
def weights(tiny_model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(vllm_engine: Any, tokenizer: Any) -> list[list[tuple[int, int]]]:
    with RolloutPipeline(CONFIG, vllm_engine, tokenizer) as pipe:
        return [identities(pipe.get_batch()) for _ in range(BATCHES)]


def suspended_batch(pipe: RolloutPipeline, mode: Any, delay: float, update: Any) -> Any:
    """``get_batch`` on a worker thread while this thread suspends after ``delay``."""
    out: dict[str, Any] = {}

    def collect() -> None:
        try:
            out["batch"] = pipe.get_batch()
        except BaseException as e:  # re-raised below
            out["error"] = e

    worker = threading.Thread(target=collect, name="test-collect")
    worker.start()
    time.sleep(delay)  # a random point in the batch (not a polling loop)
    pipe.suspend(mode)
    if update is not None:
        pipe.update_weights(update)
    pipe.resume()
    worker.join(60)
    assert not worker.is_alive(), "get_batch hung across a suspend"
    if "error" in out:
        raise out["error"]
    return out["batch"]


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(points=st.lists(POINT, min_size=BATCHES, max_size=BATCHES))
def test_random_points_lose_and_duplicate_nothing(
    points: list[tuple[Any, ...]],
    vllm_engine: Any,
    tokenizer: Any,
    weights: dict[str, torch.Tensor],
    reference: list[list[tuple[int, int]]],
) -> None:
    baseline = threads_now()
    pipe = RolloutPipeline(CONFIG, vllm_engine, tokenizer)
    got = []
    try:
        for point in points:
            if point[0] == "checkpoint":
                state = pipe.state_dict()
                pipe.close()
                pipe = RolloutPipeline(CONFIG, vllm_engine, tokenizer)
                pipe.load_state_dict(state)
            if point[0] == "suspend":
                _, mode, delay, update = point
                batch = suspended_batch(pipe, mode, delay, weights if update else None)
            else:
                batch = pipe.get_batch()
            got.append(identities(batch))
    finally:
        pipe.close()
    assert got == reference
    assert_back_to(baseline)
