"""The warm start: a small Qwen2 that plays, trained on expert episodes on this CPU.

``build_warm_start(path, recipe)`` writes a HuggingFace model directory (transformers
and vLLM load it) in three steps, deterministic from ``recipe.seed``:

1. the built-in tiny model's files (:func:`rollpipe.training.tiny_model.build_tiny_model`)
   at the recipe's size, with the tiny model's tokenizer minus the merges that join
   grid cells (``__``, ``_P``, ``#\\n``, ...): every cell of a FrozenLake or Sokoban grid
   is then one token, so a row's column is its token's distance from the newline. Token
   ids are unchanged (the merged tokens stay in the vocabulary, unused);
2. expert episodes (:mod:`rollpipe.training.expert`) in exactly the ids the pipeline
   sends, on seeds derived from ``recipe.seed`` (never :data:`EVAL_SEED`'s);
3. supervised training on response tokens (:mod:`rollpipe.training.sft`).

``warm_start_model_path()`` is what the CLI, the demo and the GRPO example use: the
copy shipped inside the package when it was built from the requested recipe, else one
built once into the user cache (like the tiny model) and reused.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.chat import DEFAULT_SYSTEM_PROMPT, ChatFormat
from rollpipe.envs.frozenlake import FrozenLake
from rollpipe.envs.sokoban import Sokoban
from rollpipe.training.expert import ExpertEpisode, action_token_ids, expert_episode
from rollpipe.training.sft import length_batches, train_sft
from rollpipe.training.warm_start_files import (
    cached_build,
    save_warm_start,
    write_model_files,
)

__all__ = [
    "DEFAULT_RECIPE",
    "SHIPPED_DIR",
    "WarmStartRecipe",
    "build_warm_start",
    "expert_stream",
    "warm_start_model_path",
]

GRID_CHARS = frozenset("_HPGXW#O*S")  # FrozenLake and Sokoban cells
SHIPPED_DIR = Path(__file__).resolve().parent / "warm_start_model"


def _stages(value: Any) -> tuple[tuple[int, int, int], ...]:
    return tuple((int(a), int(b), int(c)) for a, b, c in value)


@attrs.frozen(kw_only=True)
class WarmStartRecipe:
    """Everything that decides the warm start's weights.

    ``stages`` is the curriculum: ``(steps, max_turns, batch_size)`` each, run in
    order under one learning-rate schedule. Short episodes first are cheap (with the
    shared prefix, a one-turn episode costs about 30 tokens of compute) and teach the
    grid-to-action map; whole episodes then teach later turns and the auxiliary loss on
    the env's feedback.

    The default stops at 650 steps on purpose: the model plays (0.37 held-out greedy
    success against 0.04 for a random valid move) and leaves GRPO room to show learning
    in minutes (+23.5 points in 120 steps). Longer recipes play better (720 steps: 0.75)
    but leave GRPO little to gain quickly (800 steps: +2.5 points in 160). Held-out
    success is not monotone in the step count (685 steps: 0.22): see docs/learning.md.
    """

    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    stages: tuple[tuple[int, int, int], ...] = attrs.field(
        default=((650, 6, 16),), converter=_stages
    )
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.01
    explore: float = 0.2
    observation_weight: float = 1.0
    sokoban_fraction: float = 0.0
    threads: int = 2

    @property
    def steps(self) -> int:
        return sum(s for s, _, _ in self.stages)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON data (lists for tuples), as stored next to the weights."""
        data: dict[str, Any] = json.loads(json.dumps(attrs.asdict(self)))
        return data


DEFAULT_RECIPE = WarmStartRecipe()


def _grid_free(tokenizer_json: str) -> str:
    """The tokenizer with every merge that joins grid cells (or a cell and a newline)
    removed; the vocabulary (hence every id) is unchanged."""
    data = json.loads(tokenizer_json)

    def grid_only(token: str) -> bool:  # byte-level: "Ċ" is "\n"
        return (
            len(token) > 1
            and all(c in GRID_CHARS or c == "Ċ" for c in token)
            and any(c in GRID_CHARS for c in token)
        )

    merges = data["model"]["merges"]
    data["model"]["merges"] = [m for m in merges if not grid_only(m[0] + m[1])]
    return json.dumps(data, ensure_ascii=False, indent=1, sort_keys=True) + "\n"


def _write_model_files(out: Path, recipe: WarmStartRecipe) -> None:
    """The tiny model's files at the recipe's size and the grid-free tokenizer."""
    write_model_files(out, recipe)
    tok_path = out / "tokenizer.json"
    tok_path.write_text(_grid_free(tok_path.read_text()))


def expert_stream(
    recipe: WarmStartRecipe, tokenizer: Any, *, max_turns: int, start: int = 0
) -> Iterator[ExpertEpisode]:
    """Endless expert episodes for ``recipe`` (episode ``i`` is a pure function of
    ``recipe.seed``, ``max_turns`` and ``i``), FrozenLake and a ``sokoban_fraction`` of
    Sokoban."""
    chat = ChatFormat(tokenizer, system_prompt=DEFAULT_SYSTEM_PROMPT)
    lake, room = FrozenLake(), Sokoban()
    lake_ids = action_token_ids(tokenizer, lake.actions, lake.config.answer_format)
    room_ids = action_token_ids(tokenizer, room.actions, room.config.answer_format)
    i = start
    while True:
        rng = random.Random(derive_seed(recipe.seed, 101, max_turns, i))
        env_seed = derive_seed(recipe.seed, 100, max_turns, i)
        if rng.random() < recipe.sokoban_fraction:
            yield expert_episode(
                room,
                env_seed,
                chat,
                room_ids,
                max_turns=max_turns,
                explore=recipe.explore,
                rng=rng,
            )
        else:
            yield expert_episode(
                lake,
                env_seed,
                chat,
                lake_ids,
                max_turns=max_turns,
                explore=recipe.explore,
                rng=rng,
            )
        i += 1


def build_warm_start(
    path: str | os.PathLike[str],
    recipe: WarmStartRecipe = DEFAULT_RECIPE,
    *,
    on_step: Callable[[int, dict[str, float]], Any] | None = None,
) -> Path:
    """Train the warm start for ``recipe`` and write it to ``path``; returns it.

    Takes minutes on two CPU cores. Torch runs on ``recipe.threads`` threads during the
    build, so the same recipe gives the same weights on the same machine and software.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(path)
    _write_model_files(out, recipe)
    tokenizer = AutoTokenizer.from_pretrained(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    start = time.perf_counter()
    try:
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        stages = [
            itertools.islice(
                length_batches(
                    expert_stream(recipe, tokenizer, max_turns=turns),
                    size,
                    pool=8,
                    seed=derive_seed(recipe.seed, 102, k),
                ),
                steps,
            )
            for k, (steps, turns, size) in enumerate(recipe.stages)
        ]
        history = train_sft(
            model,
            itertools.chain(*stages),
            tokenizer.pad_token_id,
            steps=recipe.steps,
            lr=recipe.lr,
            warmup=recipe.warmup,
            weight_decay=recipe.weight_decay,
            observation_weight=recipe.observation_weight,
            on_step=on_step,
        )
    finally:
        torch.set_num_threads(threads)
    last = history[-20:]
    save_warm_start(
        model,
        out,
        {
            "recipe": recipe.as_dict(),
            "train_seconds": round(time.perf_counter() - start, 1),
            "final_action_loss": round(sum(h["action"] for h in last) / max(1, len(last)), 4),
            "final_action_acc": round(sum(h["action_acc"] for h in last) / max(1, len(last)), 4),
        },
    )
    return out


def warm_start_model_path(recipe: WarmStartRecipe = DEFAULT_RECIPE) -> Path:
    """The warm start for ``recipe``: the shipped copy when it matches, else built once
    (minutes) into the user cache (``$ROLLPIPE_CACHE_DIR`` or ``~/.cache/rollpipe``)."""
    return cached_build(
        recipe,
        shipped=SHIPPED_DIR,
        prefix="warm-start",
        build=lambda tmp: build_warm_start(tmp, recipe),
    )
