"""What the FrozenLake and the tools warm starts share: the model files at a recipe's
size, the saved weights with their recipe, and the build-once cache.

A warm start directory holds a HuggingFace model and ``rollpipe_recipe.json`` (the
format version and the recipe it was built from). ``cached_build`` returns the copy
shipped in the package when its recipe matches, else builds one into the user cache
(``$ROLLPIPE_CACHE_DIR`` or ``~/.cache/rollpipe``) once, atomically, and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from rollpipe.training.tiny_model import _cache_root, build_tiny_model

__all__ = ["FORMAT_VERSION", "RECIPE_FILE", "cached_build", "save_warm_start", "write_model_files"]

FORMAT_VERSION = 1  # bump when the same recipe writes different files
RECIPE_FILE = "rollpipe_recipe.json"


class ModelRecipe(Protocol):
    """The fields of a warm-start recipe that decide the model's shape."""

    @property
    def seed(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    def as_dict(self) -> dict[str, Any]: ...


def write_model_files(out: Path, recipe: ModelRecipe, *, tools: bool = False) -> None:
    """The tiny model's files at the recipe's size (random weights, replaced later).

    Heads narrower than 64 (vLLM's CPU attention takes 32) are written as 64-wide heads,
    then re-declared: the weight shapes of ``hidden_size`` split either way are the same.
    """
    if recipe.hidden_size % recipe.num_heads:
        raise ValueError(
            f"{type(recipe).__name__}: hidden_size {recipe.hidden_size} is not a multiple "
            f"of num_heads {recipe.num_heads}"
        )
    wide = max(1, recipe.hidden_size // 64)
    build_tiny_model(
        out,
        recipe.seed,
        hidden_size=recipe.hidden_size,
        num_layers=recipe.num_layers,
        num_heads=wide,
        num_kv_heads=wide,
        intermediate_size=recipe.intermediate_size,
        init_std=0.02,
        tools=tools,
    )
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["num_attention_heads"] = config["num_key_value_heads"] = recipe.num_heads
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_warm_start(model: Any, out: Path, summary: dict[str, Any]) -> None:
    """Write ``model``'s weights and ``summary`` (with the format version) into ``out``.

    Weights are stored in float16 (half the bytes; the package ships them): transformers
    and vLLM load them into the float32 model that config.json declares.
    """
    from safetensors.torch import save_file

    weights = {
        k: v.detach().to(torch.float16).contiguous() for k, v in sorted(model.state_dict().items())
    }
    weights.pop("lm_head.weight", None)  # tied to the embedding
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    summary = {"format": FORMAT_VERSION, **summary}
    (out / RECIPE_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def recipe_of(path: Path) -> dict[str, Any] | None:
    """The recipe a complete warm start at ``path`` was built from (None: none there)."""
    try:
        data = json.loads((path / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != FORMAT_VERSION or not (path / "model.safetensors").is_file():
        return None
    recipe = data.get("recipe")
    return recipe if isinstance(recipe, dict) else None


def cached_build(
    recipe: ModelRecipe,
    *,
    shipped: Path,
    prefix: str,
    build: Callable[[Path], Any],
    before_build: Callable[[Path], Any] | None = None,
) -> Path:
    """The shipped copy when it was built from ``recipe``, else the user cache's copy,
    built once by ``build(tmp_dir)`` and renamed into place (another process building
    the same recipe meanwhile is fine: the first rename wins)."""
    wanted = recipe.as_dict()
    if recipe_of(shipped) == wanted:
        return shipped
    key = json.dumps({"format": FORMAT_VERSION, **wanted}, sort_keys=True)
    final = _cache_root() / f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if recipe_of(final) == wanted:
        return final
    if before_build is not None:
        before_build(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if recipe_of(final) != wanted:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
