"""What every ecosystem test does: one real batch on the vLLM engine, and a scripted
player driving rollpipe's own episode loop.

``real_batch`` runs ``RolloutPipeline`` with the tiny model on an adapter named by
import path (as a user's config names it) and checks the batch is whole: no episode
errored, every row holds the env's first observation. ``play`` runs ``run_episode`` (the
loop the pipeline runs) with a ``ScriptedEngine``: a player that reads the latest
observation from the prompt tokens and answers well, so the ecosystem's own reward
reaches the trajectory.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any

from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

USER = "<|im_start|>user\n"
END = "<|im_end|>"


def latest_observation(prompt_text: str) -> str:
    """The last user message of a ChatML prompt: the env's newest observation."""
    return prompt_text.rsplit(USER, 1)[-1].split(END, 1)[0]


class ScriptedEngine:
    """Answers each request with ``player(latest observation)``: an engine for
    ``run_episode`` whose moves are scripted, not sampled."""

    version = 0
    is_paused = False

    def __init__(self, tokenizer: Any, player: Callable[[str], str]) -> None:
        self.tokenizer, self.player = tokenizer, player
        self.eot = tokenizer.convert_tokens_to_ids(END)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        observation = latest_observation(self.tokenizer.decode(list(prompt_ids)))
        ids = [*self.tokenizer.encode(self.player(observation), add_special_tokens=False)]
        ids.append(self.eot)
        return Generation(ids, [0.0] * len(ids), "stop", [0] * len(ids))


def play(
    env: Any, player: Callable[[str], str], tokenizer: Any, seed: int, turns: int
) -> Trajectory:
    """One episode of ``env`` through ``run_episode``, ``player`` choosing every move."""
    settings = EpisodeSettings(max_turns=turns, max_length=8192, sampling={"max_tokens": 256})
    engine = ScriptedEngine(tokenizer, player)
    spec = EpisodeSpec(group_id=0, episode_id=0, seed=seed)
    chat = settings.chat_format(tokenizer)
    return asyncio.run(run_episode(spec, env, engine, chat, settings))


def conversation(trajectory: Trajectory, tokenizer: Any) -> str:
    """Every token of the episode (prompts and responses), decoded."""
    ids = [t for turn in trajectory.turns for t in (*turn.prompt_ids, *turn.response_ids)]
    return str(tokenizer.decode(ids))


def real_batch(engine: Any, tokenizer: Any, name: str, config: dict[str, Any], **changes: Any):
    """One batch of 4 rows (2 groups of 2) from the tiny model on env ``name``."""
    settings = dict(
        envs=[{"name": name, "config": config, "tag": "eco"}],
        group_size=2,
        batch_size=4,
        num_groups=2,
        max_turns=2,
        max_length=2048,
        concurrency=4,
        seed=5,
        sampling={"max_tokens": 24, "temperature": 1.0},
    )
    with RolloutPipeline(PipelineConfig(**(settings | changes)), engine, tokenizer) as pipe:
        batch = pipe.get_batch()
    metrics = batch.meta_info["metrics"]
    assert len(batch) == 4
    assert metrics["dropped/errored"] == 0, metrics
    assert metrics["env/eco/trajectories"] == 4
    return batch


def first_prompts(batch: Any, tokenizer: Any) -> list[str]:
    """Each row's first prompt, decoded."""
    ids, prompt = batch.batch["input_ids"], batch.batch["prompt_mask"].bool()
    return [str(tokenizer.decode(ids[i][prompt[i]].tolist())) for i in range(len(batch))]


def known_rate(metrics: dict[str, Any], key: str) -> float:
    """A rate the env's ``action_valid`` makes known: a number in [0, 1], not NaN."""
    value = float(metrics[key])
    assert not math.isnan(value) and 0.0 <= value <= 1.0, (key, value)
    return value
