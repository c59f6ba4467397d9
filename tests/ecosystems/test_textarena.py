"""TextArena through ``TextArenaEnv``: a real batch on vLLM, a player that wins the game's
reward, the history sent once, the player's own move never echoed back (whatever sender
the game logs it with), invalid moves reported. ``nox -s textarena``."""

from __future__ import annotations

import doctest

import pytest

pytest.importorskip("textarena", reason="TextArena is not installed: run `nox -s textarena`")

import textarena
from playing import conversation, first_prompts, known_rate, play, real_batch

import rollpipe.envs.adapters.textarena as ta_adapter
from rollpipe.envs.adapters.textarena import TextArenaEnv
from rollpipe.pipeline import PipelineConfig

TA = "rollpipe.envs.adapters.textarena:TextArenaEnv"
INTRO = "You are playing Guess The Number."
HANOI = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]  # 3 disks, A to C
ECHO = textarena.ObservationType.PLAYER_ACTION


class BinarySearch:
    """Guesses the middle of what the game's hints leave open (1..20)."""

    def __init__(self) -> None:
        self.low, self.high, self.guess = 1, 20, 0

    def __call__(self, observation: str) -> str:
        if "higher" in observation:
            self.low = self.guess + 1
        elif "lower" in observation:
            self.high = self.guess - 1
        self.guess = (self.low + self.high) // 2
        return f"I guess [{self.guess}]"


def test_the_docstring_example_runs() -> None:
    assert doctest.testmod(ta_adapter).failed == 0


def test_a_real_batch_on_the_vllm_engine(vllm_engine, tokenizer) -> None:
    batch = real_batch(vllm_engine, tokenizer, TA, {"env_id": "GuessTheNumber-v0"})
    assert all(INTRO in p for p in first_prompts(batch, tokenizer))
    known_rate(batch.meta_info["metrics"], "env/eco/valid_action_rate")


def test_a_player_that_plays_well_wins_the_games_reward(tokenizer) -> None:
    env = TextArenaEnv(env_id="GuessTheNumber-v0")
    for seed in range(5):
        trajectory = play(env, BinarySearch(), tokenizer, seed, turns=10)
        assert trajectory.end_reason == "terminated", trajectory.error
        assert trajectory.success and trajectory.score == 1.0  # from the game, at the end
        assert [t.reward for t in trajectory.turns[:-1]] == [0.0] * (len(trajectory.turns) - 1)
        assert all(t.action_valid for t in trajectory.turns)
        text = conversation(trajectory, tokenizer)
        # rollpipe keeps the history: the prompt is sent once, and no move is echoed back
        assert text.count(INTRO) == 1
        assert text.count("I guess [") == len(trajectory.turns)


def test_invalid_moves_are_reported_and_end_the_game_at_the_games_limit() -> None:
    env = TextArenaEnv(env_id="GuessTheNumber-v0")
    env.reset(0)
    obs, reward, done, _, info = env.step("no number here")
    assert not info["action_valid"] and not done and "invalid move" in obs
    obs, reward, done, _, info = env.step("[99]")  # out of range: the second error loses
    assert not info["action_valid"] and done and reward == 0.0 and info["reason"]


def test_multi_player_games_and_unknown_ids_fail_when_the_config_is_built() -> None:
    with pytest.raises(ValueError, match=r"TicTacToe-v0.*single-player"):
        PipelineConfig(envs=[{"name": TA, "config": {"env_id": "TicTacToe-v0"}}])
    with pytest.raises(ValueError, match="GuessTheNumber-v0"):
        PipelineConfig(envs=[{"name": TA, "config": {"env_id": "GuessTheNumbr-v0"}}])


@pytest.mark.parametrize(
    ("env_id", "move", "sender", "new_state"),
    [
        ("TowerOfHanoi-v0-raw", "[A C]", -1, "C: [1]"),  # logged as the game's (-1)
        ("GuessTheNumber-v0-raw", "[10]", 0, "The target number is"),  # as player 0's
        ("Countdown-v0-raw", "[0 1 +]", ECHO, "Move history"),  # arguments swapped
    ],
)
def test_the_players_move_is_not_echoed_whoever_the_game_logs_as_its_sender(
    env_id: str, move: str, sender: object, new_state: str
) -> None:
    env = TextArenaEnv(env_id=env_id)
    env.reset(0)
    obs, _, _, _, info = env.step(move)
    assert info["action_valid"]
    assert sender in [logged[0] for logged in env.game.state.logs]  # the game's own record
    assert move not in obs.splitlines() and "0" not in obs.splitlines()  # no echo
    assert new_state in obs  # the game's answer to the move is there


def test_a_solved_tower_of_hanoi_shows_each_move_once(tokenizer) -> None:
    env = TextArenaEnv(env_id="TowerOfHanoi-v0-raw")
    prompt, _ = env.reset(0)
    moves = iter(HANOI)
    trajectory = play(env, lambda _: next(moves), tokenizer, seed=0, turns=len(HANOI))
    assert trajectory.end_reason == "terminated", trajectory.error
    assert trajectory.success and trajectory.score == 1.0
    text = conversation(trajectory, tokenizer)
    for move in set(HANOI):  # in the model's turns (and the rules' example), never echoed
        assert text.count(move) == HANOI.count(move) + prompt.count(move), move
    assert "You moved disk 1 from A to C." in text and "C: [1]" in text
