"""The lookup tool task: the answer is in the drawer the tool opens and nowhere else, the
expert's and the guesser's transcripts are what the warm start imitates, and the
``openai``-client agent sends the model exactly the ids LookupEnv does."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils import get_json_schema

from rollpipe.envs import make
from rollpipe.envs.lookup import DRAWERS, LOCKED, lookup_task
from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT
from rollpipe.training.lookup_agent import SYSTEM_PROMPT, TOOLS
from rollpipe.training.tool_expert import expert_episodes, expert_texts, guess_texts


@pytest.fixture(scope="module")
def tools_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from rollpipe.training.tool_warm_start import tool_warm_start_model_path

    return AutoTokenizer.from_pretrained(tool_warm_start_model_path())


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_the_tool_opens_the_drawer_the_question_names(seed: int) -> None:
    env = make("lookup")
    question, _ = env.reset(seed)
    _, (drawer, digits) = lookup_task(seed)
    assert f"drawer {drawer}?" in question and len(digits) == DRAWERS
    assert env.lookup(drawer) == str(digits[drawer - 1])
    assert env._verify(f"The digit is {digits[drawer - 1]}.", env._truth) == 1.0
    wrong = (digits[drawer - 1] + 1) % 10
    assert env._verify(f"The digit is {wrong}.", env._truth) == 0.0


def test_nothing_in_the_question_tells_the_digit() -> None:
    """Questions are one of nine strings; the digit behind each is uniform (chance 1/10)."""
    answers: dict[str, list[int]] = {}
    for seed in range(5000):
        question, (drawer, digits) = lookup_task(seed)
        answers.setdefault(question, []).append(digits[drawer - 1])
    assert len(answers) == DRAWERS
    for digits in answers.values():
        counts = [digits.count(d) / len(digits) for d in range(10)]
        assert max(counts) < 0.16 and min(counts) > 0.05, counts


def test_a_locked_tool_and_a_bad_drawer_say_so() -> None:
    locked = make("lookup", tool_available=False)
    locked.reset(1)
    assert locked.lookup(3) == LOCKED
    env = make("lookup")
    env.reset(1)
    with pytest.raises(ValueError, match="drawer must be an integer from 1 to 9, got 12"):
        env.lookup(12)
    with pytest.raises(ValueError, match="tool_available must be True or False, got 'no'"):
        make("lookup", tool_available="no")


def test_the_agent_shows_the_model_what_lookup_env_does() -> None:
    env = make("lookup")
    assert SYSTEM_PROMPT == DEFAULT_TOOL_PROMPT
    assert [get_json_schema(env.lookup)] == TOOLS


def test_expert_and_guesser_texts() -> None:
    question = "<|im_start|>user\nWhich digit is in drawer 4? Use the lookup tool, then answer."
    assert expert_texts(question) == (
        '<tool_call>\n{"name": "lookup", "arguments": {"drawer": 4}}\n</tool_call>'
    )
    answered = question + "<tool_response>\n7\n</tool_response>"
    assert expert_texts(answered) == "The digit is 7."
    assert guess_texts(question).startswith("The digit is ")
    with pytest.raises(ValueError, match="plays only the calculator and lookup envs"):
        guess_texts("<|im_start|>user\nWalk to the goal.<|im_end|>")


def _rows(tokenizer: Any, env: str) -> list[tuple[list[int], list[int]]]:
    """(ids, response mask) of the expert's episodes on ``env`` (8 seeds), sorted."""
    from rollpipe.engines.scripted import ScriptedEngine
    from rollpipe.pipeline import PipelineConfig, RolloutPipeline
    from rollpipe.training.tool_expert import TOOL_EPISODE, expert_policy

    config = PipelineConfig(
        envs=env,
        group_size=1,
        batch_size=8,
        num_groups=8,
        seed=11,
        max_turns=TOOL_EPISODE["max_turns"],
        tool_parser=TOOL_EPISODE["tool_parser"],
        sampling={"max_tokens": TOOL_EPISODE["max_tokens"]},
    )
    with (
        ScriptedEngine(expert_policy(tokenizer)) as engine,
        RolloutPipeline(config, engine, tokenizer) as pipe,
    ):
        batch = pipe.get_batch()
    assert batch is not None and len(batch) == 8
    td = batch.batch
    rows = []
    for i in range(8):
        keep = td["attention_mask"][i].bool()
        rows.append((td["input_ids"][i][keep].tolist(), td["response_mask"][i][keep].tolist()))
    assert float(td["episode_scores"].mean()) == 1.0  # the expert wins every episode
    return sorted(rows)


def test_the_agent_and_the_env_give_the_same_rows(tools_tokenizer: Any) -> None:
    """The expert played as LookupEnv episodes and through the openai-client agent (the
    front door) on the same seeds: token for token the same rows."""
    env_rows = _rows(tools_tokenizer, "lookup")
    agent_rows = _rows(tools_tokenizer, "rollpipe.training.lookup_agent:lookup_agent_env")
    assert agent_rows == env_rows


def test_expert_episodes_mix_calls_and_guesses(tools_tokenizer: Any) -> None:
    episodes = list(expert_episodes(tools_tokenizer, 4, seed=3, env="lookup", chunk=4))
    assert all(e.success and e.turns == 2 for e in episodes)
    guesses = list(
        expert_episodes(tools_tokenizer, 4, seed=3, env="lookup", texts=guess_texts, chunk=4)
    )
    assert all(e.turns == 1 for e in guesses)


def test_the_lookup_warm_start_ships_and_did_not_learn_the_calls_worth() -> None:
    """The shipped weights are the recipe's; its training mix answered 70% of the time
    without the call, which is what GRPO has to unlearn (docs/learning.md)."""
    from rollpipe.training.tool_warm_start import (
        LOOKUP_RECIPE,
        LOOKUP_SHIPPED_DIR,
        tool_warm_start_model_path,
    )

    assert tool_warm_start_model_path(LOOKUP_RECIPE) == LOOKUP_SHIPPED_DIR
    assert (LOOKUP_SHIPPED_DIR / "model.safetensors").stat().st_size < 2**20
    assert LOOKUP_RECIPE.guess_rate == 0.7


@pytest.fixture(scope="module")
def lookup_engine(tool_warm_start_engine: Any) -> Any:
    """The session's tools warm start engine (on the lookup warm start); its weights go
    back to the shipped ones afterwards, for the tests that share it."""
    from rollpipe.training.tool_warm_start import LOOKUP_SHIPPED_DIR

    yield tool_warm_start_engine
    tool_warm_start_engine.update_weights(_weights(LOOKUP_SHIPPED_DIR))


def _weights(path: Any) -> Any:
    """The model at ``path`` as the trainer holds it (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("kind", ["lookup", "lookup-agent"])
def test_grpo_steps_on_the_tool_task(kind: str, lookup_engine: Any) -> None:
    """``rollpipe train --env lookup`` / ``--env lookup-agent`` (the openai-client agent,
    through the front door) for 3 steps at a high learning rate, from the shipped warm
    start: finite losses, a new policy version each step, the trainer's log-probs still
    match the engine's after each update (the new weights reached the engine), tool
    calls made and parsed, and the held-out evaluation before and after."""
    from rollpipe.training.grpo_loop import train_grpo
    from rollpipe.training.tool_warm_start import LOOKUP_SHIPPED_DIR

    start = lookup_engine.update_weights(_weights(LOOKUP_SHIPPED_DIR))
    result = train_grpo(
        steps=3, batch_size=32, group_size=8, lr=1e-3, warmup=1, env=kind,
        eval_episodes=16, engine=lookup_engine, model_path=LOOKUP_SHIPPED_DIR,
    )  # fmt: skip
    history = result["history"]
    assert [h["version"] for h in history] == [start + 1, start + 2, start + 3]
    assert all(math.isfinite(h["loss"]) for h in history)
    assert history[0]["updates"] >= 1, history  # the warm start's groups differ in reward
    assert all(h["logprob_gap"] < 0.02 for h in history), history
    assert 1.0 < history[0]["turns"] <= 2.0  # some episodes called the tool
    assert [e["episodes"] for e in result["evals"]] == [16, 16]
