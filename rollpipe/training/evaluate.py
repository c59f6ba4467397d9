"""Held-out evaluation through the pipeline itself, and the random-valid-action baseline.

:func:`evaluate` runs ``episodes`` single-member groups on seeds derived from ``seed``
(a seed the warm start and GRPO never train on) through a :class:`RolloutPipeline` on
the given engine, greedy by default, and reports success rate and mean score. The
random baseline plays the very same seeds with a uniformly random valid action.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import attrs

from rollpipe.config import PipelineConfig
from rollpipe.engines.protocol import Engine
from rollpipe.envs.base import GridTextEnv
from rollpipe.envs.registry import make
from rollpipe.nodes.dataset import DatasetSettings
from rollpipe.nodes.episode_source import EnvChoice, EpisodeSource

__all__ = ["EVAL_SEED", "Evaluation", "evaluate", "random_valid_success"]

EVAL_SEED = 20_250_917
"""The seed held-out episodes derive from (the warm start's data and GRPO use others)."""
EVAL_MAX_TURNS = 6
"""Turn cap of held-out episodes: the shortest-path expert solves 99.5% within it."""


@attrs.frozen
class Evaluation:
    """Held-out figures: success rate, mean episode score, mean turns, valid answers."""

    episodes: int
    success: float
    score: float
    turns: float
    valid_action_rate: float

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in attrs.asdict(self).items()}


def evaluate(
    engine: Engine,
    tokenizer: Any,
    *,
    episodes: int = 200,
    seed: int = EVAL_SEED,
    env: str | EnvChoice = "frozenlake",
    max_turns: int = EVAL_MAX_TURNS,
    temperature: float = 0.0,
    max_tokens: int = 24,
    concurrency: int = 64,
    tool_parser: str | None = None,
    rows: Sequence[Any] | None = None,
) -> Evaluation:
    """Play ``episodes`` held-out episodes with ``engine`` through a RolloutPipeline
    (greedy unless ``temperature > 0``) and return their success rate and mean score.
    ``tool_parser``: the model's vLLM tool parser, for tool envs (``"hermes"``).
    ``rows``: a prompt dataset's held-out rows, played in order, cycling through them
    until ``episodes`` episodes (each row equally often when it divides ``episodes``)."""
    from rollpipe.pipeline import RolloutPipeline

    dataset = None
    if rows is not None:
        if not rows:
            raise ValueError("evaluate: rows is empty")
        dataset = DatasetSettings(rows=rows, shuffle=False, epochs=-(-episodes // len(rows)))

    config = PipelineConfig(
        envs=env,
        group_size=1,
        batch_size=1,
        num_groups=episodes,
        seed=seed,
        max_turns=max_turns,
        concurrency=concurrency,
        tool_parser=tool_parser,
        sampling={"max_tokens": max_tokens, "temperature": temperature},
        dataset=dataset,
    )
    with RolloutPipeline(config, engine, tokenizer) as pipe:
        batch = pipe.get_batch(-1)
    if batch is None:
        raise RuntimeError("evaluate: the pipeline produced no episodes")
    m = batch.meta_info["metrics"]
    return Evaluation(
        episodes=int(m["trajectories"]),
        success=float(m["success_rate"]),
        score=float(m["episode_score/mean"]),
        turns=float(m["turns/mean"]),
        valid_action_rate=float(m["valid_action_rate"]),
    )


def random_valid_success(
    *,
    episodes: int = 200,
    seed: int = EVAL_SEED,
    env: str = "frozenlake",
    max_turns: int = EVAL_MAX_TURNS,
    draws: int = 50,
) -> float:
    """Success rate of a uniformly random valid action on :func:`evaluate`'s seeds,
    averaged over ``draws`` plays of each."""
    source = EpisodeSource(episodes, 1, seed, env)
    game = make(env)
    if not isinstance(game, GridTextEnv):
        raise TypeError(f"random_valid_success needs a grid env with actions, got {env!r}")
    answer = game.config.answer_format
    wins = 0
    for group in range(episodes):
        spec = source.spec(group, 0)
        for draw in range(draws):
            rng = random.Random(draw * 1_000_003 + group)
            game.reset(spec.seed)
            success = False
            for _ in range(max_turns):
                action = rng.choice(game.actions)
                _, _, terminated, truncated, info = game.step(answer.format(action=action))
                success = bool(info["success"])
                if terminated or truncated:
                    break
            wins += success
    return wins / (episodes * draws)
