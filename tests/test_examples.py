"""Every example runs, with short settings, on the session's engine."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def restore_weights(vllm_engine, tiny_model_path):
    """Examples that train push weights into the shared engine; put the originals back."""
    yield
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32)
    vllm_engine.update_weights(original)


def test_minimal(vllm_engine):
    batch = load("minimal").main(engine=vllm_engine)
    assert len(batch) == 8
    assert "episode_score/mean" in batch.meta_info["metrics"]


def test_grpo_train(vllm_engine, restore_weights):
    start = vllm_engine.version
    history = load("grpo_train").main(steps=2, batch_size=8, engine=vllm_engine)
    assert [h["version"] for h in history] == [start + 1, start + 2]
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["reward"]) for h in history)


def test_roll_style(vllm_engine, restore_weights):
    start = vllm_engine.version
    rewards = load("roll_style").main(steps=2, engine=vllm_engine)
    assert len(rewards) == 2
    assert vllm_engine.version == start + 2


def test_custom_env(vllm_engine):
    module = load("custom_env")
    batch = module.main(engine=vllm_engine)
    assert set(batch.non_tensor_batch["tags"]) == {"guess_number"}
    scores = batch.batch["episode_scores"]
    assert ((scores >= -0.3 - 1e-6) & (scores <= 1.0 + 1e-6)).all()
    env = module.GuessNumber()
    env.reset(7)
    target = env.target
    env.reset(7)
    assert env.target == target  # seeded
    _, reward, terminated, _, info = env.step(f"<answer>{target}</answer>")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
