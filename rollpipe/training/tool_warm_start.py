"""The tools warm start: the tiny tools model trained to call the calculator and answer.

``build_tool_warm_start(path, recipe)`` writes a HuggingFace model directory,
deterministic from ``recipe.seed``:

1. the tiny model's tools variant (``build_tiny_model(tools=True)``: hermes-style
   template, ``<tool_call>`` marker tokens, every digit one token) at the recipe's size;
2. expert calculator episodes (:mod:`rollpipe.training.tool_expert`) played through the
   pipeline on seeds derived from ``recipe.seed`` (never ``EVAL_SEED``'s);
3. supervised training on every response token (:func:`rollpipe.training.sft.train_sft`).

``tool_warm_start_model_path()`` returns the copy shipped in the package when it was
built from the requested recipe, else builds it once into the user cache (logging so).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from rollpipe._utils.seeding import derive_seed
from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT
from rollpipe.training.expert import ExpertEpisode
from rollpipe.training.sft import length_batches, train_sft
from rollpipe.training.tool_expert import expert_episodes, guess_texts
from rollpipe.training.warm_start_files import (
    RECIPE_FILE,
    cached_build,
    save_warm_start,
    write_model_files,
)

__all__ = [
    "DEFAULT_TOOL_RECIPE",
    "LOOKUP_RECIPE",
    "LOOKUP_SHIPPED_DIR",
    "TOOL_SHIPPED_DIR",
    "ToolWarmStartRecipe",
    "build_tool_warm_start",
    "tool_warm_start_model_path",
]

TOOL_SHIPPED_DIR = Path(__file__).resolve().parent / "tool_warm_start_model"
LOOKUP_SHIPPED_DIR = Path(__file__).resolve().parent / "lookup_warm_start_model"
TASKS = ("calculator", "lookup")
"""The tool envs a recipe can train on (their experts are in tool_expert)."""
_log = logging.getLogger(__name__)


def _a_share(recipe: Any, attribute: Any, value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"ToolWarmStartRecipe.{attribute.name} must be in [0, 1), got {value!r}")


@attrs.frozen(kw_only=True)
class ToolWarmStartRecipe:
    """Everything that decides the tools warm start's weights: the task (``task``:
    ``"lookup"`` or ``"calculator"``, ``digits`` of the calculator's numbers, the episodes'
    ``system_prompt``), the model's size, the data (``episodes`` distinct expert
    episodes, read in length-sorted batches of ``batch_size`` for ``steps`` steps; the
    last ``guess_steps`` of them read a mix in which a ``guess_rate`` share of the
    episodes answers without the call) and the optimizer."""

    seed: int = 0
    task: str = attrs.field(default="calculator", validator=attrs.validators.in_(TASKS))
    guess_rate: float = attrs.field(default=0.0, validator=_a_share)
    guess_steps: int = 200
    digits: int = 1
    system_prompt: str | None = DEFAULT_TOOL_PROMPT  # ToolEnv's: the tokens it is played with
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 256
    steps: int = 200
    batch_size: int = 16
    episodes: int = 1024
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    threads: int = 2

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON data, as stored next to the weights."""
        data: dict[str, Any] = json.loads(json.dumps(attrs.asdict(self)))
        return data


DEFAULT_TOOL_RECIPE = ToolWarmStartRecipe()
"""The calculator's warm start (shipped): the docs' tool and agent examples play it."""
LOOKUP_RECIPE = ToolWarmStartRecipe(task="lookup", guess_rate=0.7, steps=1500, threads=1)
"""The lookup task's warm start (shipped): ``rollpipe train --env lookup`` starts from it.
1,300 steps of the expert (the copy of the drawer into the call, and of the digit into
the answer, appears after about 550-1,200 steps), then 200 of the mix in which 70% of
the episodes answer without the call."""


def initial_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The untrained weights a build at ``path``'s recipe starts from (for baselines)."""
    data = json.loads((Path(path) / RECIPE_FILE).read_text())
    recipe = ToolWarmStartRecipe(**data["recipe"])
    with tempfile.TemporaryDirectory() as tmp:
        write_model_files(Path(tmp), recipe, tools=True)
        from safetensors.torch import load_file

        return load_file(str(Path(tmp) / "model.safetensors"))


def _batches(tokenizer: Any, recipe: ToolWarmStartRecipe) -> Iterator[list[ExpertEpisode]]:
    """The recipe's training batches: the expert's episodes, then for the last
    ``guess_steps`` steps a shuffled mix in which a ``guess_rate`` share of the episodes
    answers without the call (lookup only)."""
    config: dict[str, Any] = {"system_prompt": recipe.system_prompt}
    if recipe.task == "calculator":
        config["digits"] = recipe.digits
    seed = derive_seed(recipe.seed, 200)
    expert = list(
        expert_episodes(tokenizer, recipe.episodes, seed, env=recipe.task, env_config=config)
    )
    batches = length_batches(
        itertools.chain.from_iterable(itertools.repeat(expert)),
        recipe.batch_size,
        pool=8,
        seed=derive_seed(recipe.seed, 201),
    )
    guess_steps = min(recipe.guess_steps, recipe.steps) if recipe.guess_rate > 0 else 0
    yield from itertools.islice(batches, recipe.steps - guess_steps)
    if not guess_steps:
        return
    guesses = round(len(expert) * recipe.guess_rate / (1 - recipe.guess_rate))
    seed = derive_seed(recipe.seed, 202)
    mixed = expert + list(
        expert_episodes(
            tokenizer, guesses, seed, env=recipe.task, env_config=config, texts=guess_texts
        )
    )
    random.Random(derive_seed(recipe.seed, 203)).shuffle(mixed)
    # unsorted batches: each holds calls and guesses in the mix's proportion
    cycle = itertools.chain.from_iterable(itertools.repeat(mixed))
    for _ in range(guess_steps):
        yield list(itertools.islice(cycle, recipe.batch_size))


def build_tool_warm_start(
    path: str | os.PathLike[str],
    recipe: ToolWarmStartRecipe = DEFAULT_TOOL_RECIPE,
    *,
    on_step: Callable[[int, dict[str, float]], Any] | None = None,
) -> Path:
    """Train the tools warm start for ``recipe`` and write it to ``path``; returns it.

    Torch runs on ``recipe.threads`` threads during the build, so the same recipe gives
    the same weights on the same machine and software.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(path)
    write_model_files(out, recipe, tools=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    start = time.perf_counter()
    try:
        batches = _batches(tokenizer, recipe)
        first = next(batches)  # the expert's episodes are played before the clock below
        data_seconds = time.perf_counter() - start
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        history = train_sft(
            model,
            itertools.chain([first], batches),
            tokenizer.pad_token_id,
            steps=recipe.steps,
            lr=recipe.lr,
            warmup=recipe.warmup,
            weight_decay=recipe.weight_decay,
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
            "expert_seconds": round(data_seconds, 1),
            "train_seconds": round(time.perf_counter() - start, 1),
            "final_loss": round(sum(h["format"] for h in last) / max(1, len(last)), 4),
        },
    )
    return out


def tool_warm_start_model_path(recipe: ToolWarmStartRecipe = DEFAULT_TOOL_RECIPE) -> Path:
    """The tools warm start for ``recipe``: the shipped copy when it matches, else built
    once (minutes) into the user cache (``$ROLLPIPE_CACHE_DIR`` or ``~/.cache/rollpipe``)."""
    return cached_build(
        recipe,
        shipped=LOOKUP_SHIPPED_DIR if recipe.task == "lookup" else TOOL_SHIPPED_DIR,
        prefix=f"{recipe.task}-warm-start",
        build=lambda tmp: build_tool_warm_start(tmp, recipe),
        before_build=lambda final: _log.warning(
            "building the tools warm start into %s (a few minutes on 2 CPU cores, once)", final
        ),
    )
