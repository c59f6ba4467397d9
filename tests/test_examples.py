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


def _first_prompts(batch) -> dict[int, list[int]]:
    """Each group's first prompt ids (the row's tokens before its first response)."""
    td = batch.batch
    prompts = {}
    for i in range(len(batch)):
        ids = td["input_ids"][i][td["attention_mask"][i].bool()]
        response = td["response_mask"][i][td["attention_mask"][i].bool()]
        first = int(response.nonzero()[0])
        prompts[int(td["traj_group_id"][i])] = ids[:first].tolist()
    return prompts


def _well_formed_and_winning(batch) -> dict[str, float]:
    """The lookup warm start on its first run: it calls in about 4 episodes of 10, its
    calls well formed, and wins about 4 in 10 (docs/tools.md)."""
    metrics = batch.meta_info["metrics"]
    assert metrics["tool/calls"] >= 0.2 * len(batch), metrics
    assert metrics["tool/malformed"] <= 0.05 * metrics["tool/calls"], metrics
    assert metrics["success_rate"] >= 0.2, metrics
    return metrics


def test_tool_agent_calls_the_tool_and_wins_on_the_first_run(tool_warm_start_engine, capsys):
    batch = load("tool_agent").main(engine=tool_warm_start_engine)
    assert len(batch) == 256
    _well_formed_and_winning(batch)
    shown = capsys.readouterr().out
    assert "tool/calls: " in shown and "success_rate: " in shown
    assert '[[<tool_call>\n{"name": "lookup"' in shown  # a won episode, its call marked


def test_openai_agent_sends_what_tool_env_shows_and_wins(tool_warm_start_engine):
    """Through the front door the agent's first prompts are, token for token, the ones the
    lookup ToolEnv renders for the same seeds: the conversation the warm start was
    trained on, hence its well-formed calls."""
    agent = load("openai_agent").main(engine=tool_warm_start_engine)
    assert len(agent) == 256
    assert set(agent.non_tensor_batch["end_reasons"]) == {"terminated"}
    _well_formed_and_winning(agent)
    tools = load("tool_agent").main(engine=tool_warm_start_engine, batch_size=16)
    shown = _first_prompts(tools)
    assert shown and all(_first_prompts(agent)[g] == ids for g, ids in shown.items())
