"""The sums warm start: the tiny model trained to imitate a sloppy adder.

``build_sum_warm_start(path, recipe)`` writes a HuggingFace model directory,
deterministic from ``recipe.seed``:

1. the tiny model's files (every digit one token) at the recipe's size;
2. the sloppy teacher's answers (:mod:`rollpipe.training.sum_task`: right 3 times in 10,
   one off otherwise) to the 75 training problems, ``recipe.repeats`` times each, played
   through the pipeline (PromptTask, no system message); the held-out problems never;
3. supervised training on every response token (:func:`rollpipe.training.sft.train_sft`).

``sum_warm_start_model_path()`` returns the copy shipped in the package when it was built
from the requested recipe, else builds it once into the user cache (logging so).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from rollpipe._utils.seeding import derive_seed
from rollpipe.training.sft import length_batches, train_sft
from rollpipe.training.sum_task import teacher_episodes
from rollpipe.training.warm_start_files import cached_build, save_warm_start, write_model_files

__all__ = [
    "DEFAULT_SUM_RECIPE",
    "SUM_SHIPPED_DIR",
    "SumWarmStartRecipe",
    "build_sum_warm_start",
    "sum_warm_start_model_path",
]

SUM_SHIPPED_DIR = Path(__file__).resolve().parent / "sum_warm_start_model"
_log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class SumWarmStartRecipe:
    """Everything that decides the sums warm start's weights: the model's size, the
    teacher data (``repeats`` answers to each training problem, read ``steps *
    batch_size`` times in shuffled batches) and the optimizer."""

    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 256
    repeats: int = 10
    steps: int = 2500
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    threads: int = 1

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON data, as stored next to the weights."""
        data: dict[str, Any] = json.loads(json.dumps(attrs.asdict(self)))
        return data


DEFAULT_SUM_RECIPE = SumWarmStartRecipe()


def build_sum_warm_start(
    path: str | os.PathLike[str],
    recipe: SumWarmStartRecipe = DEFAULT_SUM_RECIPE,
    *,
    on_step: Callable[[int, dict[str, float]], Any] | None = None,
) -> Path:
    """Train the sums warm start for ``recipe`` and write it to ``path``; returns it.

    Torch runs on ``recipe.threads`` threads during the build, so the same recipe gives
    the same weights on the same machine and software.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(path)
    write_model_files(out, recipe)
    tokenizer = AutoTokenizer.from_pretrained(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    start = time.perf_counter()
    try:
        episodes = list(teacher_episodes(tokenizer, recipe.repeats, derive_seed(recipe.seed, 300)))
        data_seconds = time.perf_counter() - start
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        passes = itertools.chain.from_iterable(itertools.repeat(episodes))
        batches = length_batches(
            passes, recipe.batch_size, pool=8, seed=derive_seed(recipe.seed, 301)
        )
        history = train_sft(
            model,
            itertools.islice(batches, recipe.steps),
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
            "teacher_seconds": round(data_seconds, 1),
            "train_seconds": round(time.perf_counter() - start, 1),
            "final_loss": round(sum(h["format"] for h in last) / max(1, len(last)), 4),
        },
    )
    return out


def sum_warm_start_model_path(recipe: SumWarmStartRecipe = DEFAULT_SUM_RECIPE) -> Path:
    """The sums warm start for ``recipe``: the shipped copy when it matches, else built
    once (about a minute on 2 CPU cores) into the user cache (``$ROLLPIPE_CACHE_DIR`` or
    ``~/.cache/rollpipe``)."""
    return cached_build(
        recipe,
        shipped=SUM_SHIPPED_DIR,
        prefix="sum-warm-start",
        build=lambda tmp: build_sum_warm_start(tmp, recipe),
        before_build=lambda final: _log.warning(
            "building the sums warm start into %s (about a minute on 2 CPU cores, once)", final
        ),
    )
