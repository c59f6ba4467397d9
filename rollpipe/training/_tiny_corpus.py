"""The tiny model's tokenizer corpus: env grids, answers and chat scaffolding, fixed.

``tiny_model._train_tokenizer`` trains the tiny model's byte-level BPE tokenizer on it
(plus ``tiny_tools.tool_corpus()`` for the tool-calling variant). It never depends on the
build arguments, so the tokenizer is the same for every seed.
"""

from __future__ import annotations

import random

__all__ = ["training_corpus"]

_ACTIONS = ("Left", "Down", "Right", "Up", "Push", "left", "down", "right", "up")
_PROSE = (
    "You are playing FrozenLake. Reach the goal G without falling into a hole O.",
    "You are playing Sokoban. Push every box X onto a target O. Walls are #.",
    "P is the player, _ is frozen ice, O is a hole, G is the goal.",
    "The symbols are: # wall, _ empty, O target, X box, √ box on target, P player, S player "
    "on target.",
    "Decide the next action. Answer with one of Left, Down, Right, Up inside <answer></answer>.",
    "Think step by step inside <think></think>, then give your answer inside <answer></answer>.",
    "You can move Left, Right, Up or Down. The ice is slippery.",
    "Invalid action. Your answer must look like <answer>Left</answer>.",
    "Reward: 1.0. You reached the goal. Reward: 0.0. Reward: -0.1. Turn 1 of 10.",
    "The player moved. The box moved onto the target. You fell into a hole.",
    "You are a helpful assistant.",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10",
    "Current state:",
    "Observation:",
    "Action:",
)


def _grid_text(rng: random.Random, symbols: str, size: int, sep: str) -> str:
    rows = []
    for _ in range(size):
        rows.append(sep.join(rng.choice(symbols) for _ in range(size)))
    return "\n".join(rows)


def training_corpus() -> list[str]:
    """A fixed, built-in corpus: env grids, answers and chat scaffolding."""
    rng = random.Random(20240611)  # fixed: the tokenizer never depends on build arguments
    corpus: list[str] = []
    for i in range(600):
        size = 3 + i % 5
        lake = _grid_text(rng, "P___OG", size, "" if i % 2 else " ")
        room = _grid_text(rng, "#__OXP√S", size, "" if i % 3 else " ")
        action = _ACTIONS[i % len(_ACTIONS)]
        prose = _PROSE[i % len(_PROSE)]
        corpus.append(
            f"system\n{_PROSE[10]}\nuser\n{prose}\nCurrent state:\n{lake}\n"
            f"assistant\n<think>I should go {action}.</think><answer>{action}</answer>\n"
        )
        corpus.append(f"user\nObservation:\n{room}\nassistant\n<answer>{action}</answer>\n")
    corpus.extend(_PROSE)
    return corpus
