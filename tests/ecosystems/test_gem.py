"""gem (``gem-llm``) through ``GemEnv``: a real batch on vLLM, a binary-search player that
earns gem's success reward, a solved Sudoku counted a success though it pays a share per
cell, reproducible seeds under interleaving. ``nox -s gem``."""

from __future__ import annotations

import doctest
import itertools
import math
import re
from collections.abc import Sequence

import pytest

pytest.importorskip("gem", reason="gem-llm is not installed: run `nox -s gem`")

from playing import conversation, first_prompts, latest_observation, play, real_batch

import rollpipe.envs.adapters.gem as gem_adapter
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.envs import make
from rollpipe.envs.adapters.gem import GemEnv
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

GEM = "rollpipe.envs.adapters.gem:GemEnv"
GUESS = "game:GuessTheNumber-v0-easy"  # 1..10 in 4 turns
GAME_2048 = "game:Game2048-v0-easy"
SUDOKU = "game:Sudoku-v0-easy"  # 4x4; each right cell pays 1 / (empty cells)


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


def board(observation: str) -> list[list[int]]:
    """The Sudoku board gem shows (rows ``R1 1 . | 3 4``; ``.`` is 0)."""
    rows = re.findall(r"^R\d+ (.*)$", observation, re.M)
    return [[0 if c == "." else int(c) for c in row.split() if c != "|"] for row in rows]


def solve(grid: list[list[int]]) -> list[list[int]] | None:
    """The grid filled in by backtracking (gem's puzzles have one solution)."""
    n, box = len(grid), math.isqrt(len(grid))
    empty = next(((r, c) for r, c in itertools.product(range(n), repeat=2) if not grid[r][c]), None)
    if empty is None:
        return grid
    r, c = empty
    top, left = r - r % box, c - c % box
    used = {*grid[r], *(row[c] for row in grid)}
    used |= {grid[i][j] for i in range(top, top + box) for j in range(left, left + box)}
    for digit in set(range(1, n + 1)) - used:
        grid[r][c] = digit
        if solve(grid):
            return grid
    grid[r][c] = 0
    return None


def sudoku_player(tokenizer) -> ScriptedEngine:
    """Fills the first empty cell of the board gem just showed with the solution's digit."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def policy(prompt: Sequence[int], params) -> list[int]:
        current = board(latest_observation(tokenizer.decode(list(prompt))))
        solution = solve([row[:] for row in current])
        assert solution is not None, current
        r, c = next((r, c) for r, row in enumerate(current) for c, v in enumerate(row) if not v)
        move = f"\\boxed{{{r + 1} {c + 1} {solution[r][c]}}}"
        return [*tokenizer.encode(move, add_special_tokens=False), eot]

    return ScriptedEngine(policy)


def test_a_solved_sudoku_is_a_success_though_each_cell_pays_a_share(tokenizer) -> None:
    config = PipelineConfig(
        envs=[{"name": GEM, "config": {"env_id": SUDOKU}, "tag": "sudoku"}],
        group_size=2,
        batch_size=4,
        max_turns=16,
        max_length=8192,
        seed=7,
    )
    with sudoku_player(tokenizer) as engine, RolloutPipeline(config, engine, tokenizer) as pipe:
        batch = pipe.get_batch()
    metrics = batch.meta_info["metrics"]
    assert metrics["dropped/errored"] == 0, metrics
    assert set(batch.non_tensor_batch["end_reasons"]) == {"terminated"}
    # each right cell paid 1 / (empty cells): the last one alone is far below 1.0 ...
    assert metrics["env/sudoku/turns/min"] > 1
    # ... yet the game said it is solved, so every episode is a success
    assert metrics["env/sudoku/success_rate"] == 1.0 and metrics["success_rate"] == 1.0
    assert metrics["env/sudoku/success"] == 1.0
    scores = batch.batch["episode_scores"].tolist()
    assert scores == pytest.approx([1.0] * 4)  # the shares add up to one solved puzzle


def test_a_partial_reward_is_not_a_success() -> None:
    env = GemEnv(env_id=SUDOKU)
    obs, _ = env.reset(3)
    current = board(obs)
    solution = solve([row[:] for row in current])
    assert solution is not None
    r, c = next((r, c) for r, row in enumerate(current) for c, v in enumerate(row) if not v)
    _, reward, terminated, _, info = env.step(f"\\boxed{{{r + 1} {c + 1} {solution[r][c]}}}")
    assert 0.0 < reward < 1.0 and not terminated and not info["success"]
