"""The warm start: expert data in the pipeline's own ids, a deterministic build, and a
shipped policy that plays FrozenLake well above chance through the real pipeline."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec
from rollpipe.config import PipelineConfig
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.envs.frozenlake import FrozenLake, shortest_path
from rollpipe.envs.sokoban import Sokoban
from rollpipe.envs.sokoban_gen import solve
from rollpipe.training.expert import action_token_ids, expert_episode, optimal_actions
from rollpipe.training.warm_start import (
    DEFAULT_RECIPE,
    SHIPPED_DIR,
    WarmStartRecipe,
    build_warm_start,
    expert_stream,
    warm_start_model_path,
)


class ReplayEngine:
    """Answers each request with the next scripted response; records the prompts."""

    version = 0
    is_paused = False

    def __init__(self, responses: Sequence[Sequence[int]]) -> None:
        self.responses = [list(r) for r in responses]
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.responses.pop(0)
        return Generation(ids, [0.0] * len(ids), "stop", [0] * len(ids))


@pytest.mark.parametrize("env_cls", [FrozenLake, Sokoban])
def test_expert_episodes_are_the_ids_the_pipeline_sends(tokenizer: Any, env_cls: Any) -> None:
    """Replaying an expert episode's responses through ``run_episode`` (the pipeline's
    own episode loop, with the pipeline's default chat settings) gives the same ids."""
    config = PipelineConfig()
    chat = ChatFormat(tokenizer, system_prompt=config.system_prompt)
    env = env_cls()
    ids = action_token_ids(tokenizer, env.actions, env.config.answer_format)
    checked = 0
    for seed in range(6):
        episode = expert_episode(env, seed, chat, ids, max_turns=6, explore=0.3)
        responses = [episode.ids[a:b] for a, b in episode.responses]
        engine = ReplayEngine(responses)
        spec = EpisodeSpec(group_id=0, episode_id=0, seed=seed)
        trajectory = asyncio.run(
            run_episode(
                spec,
                env_cls(),
                engine,
                chat,
                EpisodeSettings(
                    sampling=config.sampling, max_turns=6, max_length=config.max_length
                ),
            )
        )
        sent = [t for turn in trajectory.turns for t in (*turn.prompt_ids, *turn.response_ids)]
        assert sent == episode.ids.tolist()
        assert trajectory.success == episode.success
        assert len(trajectory.turns) == episode.turns
        checked += episode.turns
    assert checked > 12


def test_expert_targets_and_optimal_actions(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    env = FrozenLake()
    ids = action_token_ids(tokenizer, env.actions, env.config.answer_format)
    assert len(set(ids.values())) == 4
    for seed in range(20):
        episode = expert_episode(env, seed, chat, ids, max_turns=10)
        env.reset(seed)
        assert env.lake is not None
        assert episode.success and episode.turns == len(shortest_path(env.lake))
        # every optimal action shortens the path by one; the others do not
        optimal, _ = optimal_actions(env)
        for action in env.actions:
            trial = copy.deepcopy(env)
            _, _, done, _, info = trial.step(f"<answer>{action}</answer>")
            left = 0 if info["success"] else None
            if not done and trial.lake is not None and trial.position != env.position:
                path = shortest_path(attrs.evolve(trial.lake, start=trial.position))
                left = None if path is None else len(path)
            assert (left == len(shortest_path(env.lake)) - 1) == (action in optimal)
        # targets sit one position before the token they predict; actions are left to
        # the any-optimal loss
        for position, choices in episode.actions:
            assert int(episode.ids[position + 1]) in choices
            assert episode.targets[position] == -1
        for i in (episode.targets >= 0).nonzero()[0]:
            assert episode.targets[i] == episode.ids[i + 1]


def test_sokoban_expert_solves(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    env = Sokoban()
    ids = action_token_ids(tokenizer, env.actions, env.config.answer_format)
    for seed in range(3):
        env.reset(seed)
        assert env.room is not None
        length = len(solve(env.room) or [])
        episode = expert_episode(env, seed, chat, ids, max_turns=50)
        assert episode.success and episode.turns == length


def test_warm_start_tokenizer_writes_one_token_per_grid_cell(tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(warm_start_model_path())
    assert ours.get_vocab() == tokenizer.get_vocab()  # same ids as the tiny model's
    for env in (FrozenLake(), Sokoban()):
        env.reset(3)
        grid = env.render()
        pieces = [ours.decode([i]) for i in ours(grid, add_special_tokens=False)["input_ids"]]
        assert pieces == [c for c in grid]
        prose = "You moved Left. Answer with one action, e.g. <answer>Left</answer>"
        assert ours(prose)["input_ids"] == tokenizer(prose)["input_ids"]


def test_build_is_deterministic(tmp_path: Path) -> None:
    recipe = WarmStartRecipe(
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        stages=((3, 2, 4),),
        warmup=1,
    )
    a = build_warm_start(tmp_path / "a", recipe)
    b = build_warm_start(tmp_path / "b", recipe)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    c = build_warm_start(tmp_path / "c", attrs.evolve(recipe, seed=1))
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    stored = json.loads((a / "rollpipe_recipe.json").read_text())
    assert stored["recipe"] == recipe.as_dict()


def test_warm_start_is_shipped_and_learned_the_expert() -> None:
    """The default recipe's weights ship with the package (no build on a fresh machine)
    and pick an optimal action on most held-out expert states."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollpipe.training.sft import batch_loss

    path = warm_start_model_path()
    assert path == SHIPPED_DIR
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    held_out = attrs.evolve(DEFAULT_RECIPE, seed=12345, explore=0.0)
    stream = expert_stream(held_out, tok, max_turns=6)
    episodes = [next(stream) for _ in range(64)]
    with torch.no_grad():
        _, parts = batch_loss(model, episodes, tok.pad_token_id)
    assert parts["action_acc"] > 0.7, parts  # 0.79 for the shipped weights
    assert parts["format"] < 0.01, parts


def test_warm_start_plays_through_the_pipeline() -> None:
    """Greedy, on held-out seeds, through RolloutPipeline on a vLLM engine: well above
    a random valid action on the same seeds and turn cap."""
    from transformers import AutoTokenizer

    from rollpipe.engines.vllm import VLLMEngine
    from rollpipe.training.evaluate import evaluate, random_valid_success

    path = warm_start_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    with VLLMEngine(path, kv_cache_space_gib=0.5, max_model_len=1024) as engine:
        result = evaluate(engine, tok, episodes=60)
    baseline = random_valid_success(episodes=60, draws=20)
    assert result.episodes == 60
    assert result.valid_action_rate > 0.95
    # 0.28 for the shipped weights on these 60 seeds (0.37 on 200), against 0.04
    assert result.success > max(0.2, baseline + 0.15), (result, baseline)
