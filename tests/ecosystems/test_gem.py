"""gem (``gem-llm``) through ``GemEnv``: a real batch on vLLM, a binary-search player that
earns gem's success reward, reproducible seeds under interleaving. ``nox -s gem``."""

from __future__ import annotations

import doctest
import math
import re

import pytest

pytest.importorskip("gem", reason="gem-llm is not installed: run `nox -s gem`")

from playing import conversation, first_prompts, play, real_batch

import rollpipe.envs.adapters.gem as gem_adapter
from rollpipe.envs import make
from rollpipe.envs.adapters.gem import GemEnv
from rollpipe.pipeline import PipelineConfig

GEM = "rollpipe.envs.adapters.gem:GemEnv"
GUESS = "game:GuessTheNumber-v0-easy"  # 1..10 in 4 turns
GAME_2048 = "game:Game2048-v0-easy"


class BinarySearch:
    """Guesses the middle of what gem's hints leave open."""

    def __init__(self, low: int = 1, high: int = 10) -> None:
        self.low, self.high, self.guess = low, high, 0

    def __call__(self, observation: str) -> str:
        hint = re.search(r"target number is (higher|lower) than (\d+)", observation)
        if hint:
            number = int(hint.group(2))
            if hint.group(1) == "higher":
                self.low = number + 1
            else:
                self.high = number - 1
        self.guess = (self.low + self.high) // 2
        return f"My guess is \\boxed{{{self.guess}}}"


def test_the_docstring_example_runs() -> None:
    assert doctest.testmod(gem_adapter).failed == 0


def test_a_real_batch_on_the_vllm_engine(vllm_engine, tokenizer) -> None:
    batch = real_batch(vllm_engine, tokenizer, GEM, {"env_id": GUESS})
    assert all("You are playing Guess The Number." in p for p in first_prompts(batch, tokenizer))
    # gem does not report action_valid: unknown turns, so the rate is NaN, not 0
    assert math.isnan(batch.meta_info["metrics"]["env/eco/valid_action_rate"])


def test_a_player_that_plays_well_earns_gems_reward(tokenizer) -> None:
    env = GemEnv(env_id=GUESS)
    for seed in range(6):  # binary search finds 1..10 within gem's 4 turns
        trajectory = play(env, BinarySearch(), tokenizer, seed, turns=4)
        assert trajectory.end_reason == "terminated", trajectory.error
        assert trajectory.success and trajectory.score == 1.0  # gem's success reward
        # the instructions are sent once: rollpipe keeps the history, gem does not re-send it
        assert conversation(trajectory, tokenizer).count("You are playing Guess The Number.") == 1


def test_seeds_fix_episodes_however_envs_interleave() -> None:
    """gem draws from the global ``random`` (2048 spawns tiles in ``step``); each adapter keeps
    a private copy, so a seed fixes the episode whatever other envs drew meanwhile."""
    alone = []
    for seed in (1, 2):
        env = GemEnv(env_id=GAME_2048)
        alone.append([env.reset(seed)[0], env.step("\\boxed{up}")[0]])
    a, b = GemEnv(env_id=GAME_2048), GemEnv(env_id=GAME_2048)
    first = [a.reset(1)[0], b.reset(2)[0]]
    second = [a.step("\\boxed{up}")[0], b.step("\\boxed{up}")[0]]
    assert [[first[0], second[0]], [first[1], second[1]]] == alone


def test_unknown_ids_fail_when_the_config_is_built() -> None:
    with pytest.raises(ValueError, match=r"GuessTheNumber-v0-easy"):
        PipelineConfig(envs=[{"name": GEM, "config": {"env_id": "game:GuessTheNumbr-v0-easy"}}])
    with pytest.raises(ValueError, match="rejects its config"):
        PipelineConfig(envs=[{"name": GEM, "config": {}}])  # env_id is required
    assert isinstance(make(GEM, env_id=GUESS), GemEnv)
