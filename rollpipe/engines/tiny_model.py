"""Moved: the built-in tiny model lives in :mod:`rollpipe.training.tiny_model` (demo and
training material, not part of the rollout core, which never imports it).

Importing this old path fails at once, saying where to import from: a forwarding shim
here would be an import from the engines up into training, the one arrow the layout
keeps out. ``from rollpipe import build_tiny_model, default_model_path`` works as it
always did.
"""

raise ImportError(
    "rollpipe.engines.tiny_model moved to rollpipe.training.tiny_model: write "
    "`from rollpipe.training.tiny_model import ...`, or `from rollpipe import "
    "build_tiny_model, default_model_path` (the tiny model is demo material, kept out of "
    "the engines)"
)
