"""reasoning-gym through ``ReasoningGymEnv``: a real batch on vLLM, a solver that earns the
task's own score, the seed picking the item. ``nox -s reasoning_gym``."""

from __future__ import annotations

import doctest
import re

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed: nox -s reasoning_gym")

from playing import first_prompts, known_rate, play, real_batch

import rollpipe.envs.adapters.reasoning_gym as rg_adapter
from rollpipe.envs.adapters.reasoning_gym import ReasoningGymEnv, task_names
from rollpipe.pipeline import PipelineConfig

RG = "rollpipe.envs.adapters.reasoning_gym:ReasoningGymEnv"


def chain_sum_solver(observation: str) -> str:
    """Adds up ``a + b - c =`` as chain_sum asks."""
    expression = observation.split(":", 1)[1].split("=", 1)[0]
    terms = re.findall(r"([+-]?)\s*(\d+)", expression)
    total = sum(-int(n) if sign == "-" else int(n) for sign, n in terms)
    return f"Adding up: <answer>{total}</answer>"


def test_the_docstring_example_runs() -> None:
    assert doctest.testmod(rg_adapter).failed == 0


def test_a_real_batch_on_the_vllm_engine(vllm_engine, tokenizer) -> None:
    batch = real_batch(vllm_engine, tokenizer, RG, {"task": "chain_sum", "max_terms": 3})
    prompts = first_prompts(batch, tokenizer)
    assert all("arithmetic problem" in p and "<answer>" in p for p in prompts)
    metrics = batch.meta_info["metrics"]
    assert metrics["turns/mean"] == 1.0  # one question, one answer
    known_rate(metrics, "env/eco/valid_action_rate")  # an <answer> found or not: known
    assert "env/eco/score" in metrics


def test_a_solver_earns_the_tasks_own_score(tokenizer) -> None:
    env = ReasoningGymEnv(task="chain_sum", min_terms=2, max_terms=4)
    for seed in range(5):
        trajectory = play(env, chain_sum_solver, tokenizer, seed, turns=3)
        assert trajectory.end_reason == "terminated" and len(trajectory.turns) == 1
        assert trajectory.success and trajectory.score == 1.0
        assert trajectory.env_metrics["score"] == 1.0
    wrong = play(env, lambda _: "<answer>nope</answer>", tokenizer, 0, turns=3)
    assert wrong.score == 0.0 and not wrong.success
    missing = play(env, lambda _: "no tags", tokenizer, 0, turns=3)
    assert missing.turns[0].action_valid is False


def test_the_seed_picks_the_item() -> None:
    env = ReasoningGymEnv(task="basic_arithmetic")
    questions = [env.reset(seed)[0] for seed in (3, 4, 3)]
    assert questions[0] == questions[2] != questions[1]
    # the item reasoning-gym itself generates for that seed
    import reasoning_gym

    assert questions[0].startswith(
        reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=1)[0]["question"]
    )


def test_bad_names_and_config_fail_when_the_config_is_built() -> None:
    assert "chain_sum" in task_names() and len(task_names()) > 90
    with pytest.raises(ValueError, match=r"chain_sum"):
        PipelineConfig(envs=[{"name": RG, "config": {"task": "chain_summ"}}])
    with pytest.raises(ValueError, match="max_termz"):
        PipelineConfig(envs=[{"name": RG, "config": {"task": "chain_sum", "max_termz": 3}}])
