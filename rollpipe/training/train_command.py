"""``rollpipe train``: GRPO from the warm start on CPU, with a learning curve.

The same options as ``examples/grpo_train.py``; each maps onto
:func:`rollpipe.training.grpo_loop.train_grpo` (see docs/learning.md). The defaults are the
measured run: 120 steps of 128 trajectories (16 groups of 8), lr 2e-4, GiGPO advantages,
held-out success on 200 seeds every 40 steps, about 11 minutes on 2 CPU cores.
``--env calculator`` trains the tools warm start on the calculator tool task instead.
``--env sums`` trains the sums warm start on a prompt dataset (RLVR, ``PromptTask``);
``--env lookup`` / ``lookup-agent`` the lookup warm start on a tool task, as a ToolEnv or
as an ``openai``-client agent through the front door.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["add_train_arguments", "train_from_args"]

# the smallest value each count may take (the rest is checked by PipelineConfig and train)
_AT_LEAST: dict[str, int] = {"steps": 0, "batch_size": 1, "group_size": 1, "eval_every": 0}


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The training options on ``parser`` (returned)."""
    parser.add_argument(
        "--env",
        default="frozenlake",
        help="task to train on: frozenlake (default), lookup (a tool the answer needs, "
        "hermes parser, from the lookup warm start), lookup-agent (the same task as an "
        "openai-client agent, through the front door), sums (a prompt dataset through "
        "PromptTask, evaluated on its held-out problems) or calculator (tool calls, from "
        "the calculator warm start: does not learn yet)",
    )
    parser.add_argument("--steps", type=int, default=120, help="GRPO steps (default 120)")
    parser.add_argument("--batch-size", type=int, default=128, help="trajectories per step")
    parser.add_argument("--group-size", type=int, default=8, help="trajectories per group")
    parser.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate")
    parser.add_argument(
        "--turn-weight", type=float, default=1.0, help="GiGPO turn-level advantage weight"
    )
    parser.add_argument(
        "--mini-batch-size",
        type=int,
        help="rows per optimizer step (verl's ppo_mini_batch_size; default: the whole batch)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=40, help="0: before and after only")
    parser.add_argument("--eval-episodes", type=int, default=200, help="0: no evaluation")
    parser.add_argument("--model", type=Path, help="HF model directory (default: warm start)")
    parser.add_argument("--plot", type=Path, default=Path("grpo_curve.png"))
    parser.add_argument("--out", type=Path, help="write the history and evaluations as JSON")
    return parser


def train_from_args(args: argparse.Namespace, console: Console | None = None) -> dict[str, Any]:
    """Run :func:`~rollpipe.training.grpo_loop.train_grpo` with the parsed options."""
    for name, low in _AT_LEAST.items():
        value = getattr(args, name)
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    from rollpipe.training.train_tasks import train_task

    train_task(args.env)  # an unknown --env fails before anything starts
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the per-step table readable
    from rollpipe.training.grpo_loop import train_grpo  # torch and transformers: not for --help

    return train_grpo(
        steps=args.steps,
        batch_size=args.batch_size,
        group_size=args.group_size,
        lr=args.lr,
        turn_weight=args.turn_weight,
        mini_batch_size=args.mini_batch_size,
        seed=args.seed,
        env=args.env,
        eval_every=args.eval_every,
        eval_episodes=args.eval_episodes,
        model_path=args.model,
        plot=args.plot,
        out=args.out,
        console=console,
    )
