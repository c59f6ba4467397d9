"""The ``rollpipe`` command: ``rollpipe run`` (the main job), ``rollpipe train`` (GRPO
from the warm start, :mod:`rollpipe.training.train_command`) and ``rollpipe inspect``.

``rollpipe run`` with no arguments runs FrozenLake rollouts on the vLLM engine with the
warm-started policy that ships with rollpipe (it plays: success well above zero) and
prints a summary per batch and in total; ``--model tiny`` uses the random-weight tiny
model instead (built once, cached).
Every option maps onto :class:`rollpipe.pipeline.PipelineConfig`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollpipe.engines.records import EngineError
from rollpipe.pipeline import PipelineConfig
from rollpipe.training.train_command import add_train_arguments, train_from_args

# flag name -> PipelineConfig field
CONFIG_FLAGS = {
    "env": "envs",
    "batch_size": "batch_size",
    "group_size": "group_size",
    "concurrency": "concurrency",
    "seed": "seed",
    "max_turns": "max_turns",
}
SUMMARY_COLUMNS = (
    "batch",
    "rows",
    "score",
    "success",
    "turns",
    "resp tokens",
    "tokens/s",
    "wait s",
)
# What the columns mean, printed under the table: lines of at most 80 characters, so a
# terminal of 80 columns breaks none of them mid-sentence.
LEGEND = (
    "score: mean episode score (sum of its rewards) · turns: mean turns per episode",
    "success: share of episodes the env marked solved · rows: trajectories in batch",
    "resp tokens: tokens the model generated · wait s: time get_batch waited for it",
    "tokens/s: tokens generated per second (batch: since the start; total: ÷ wait s)",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollpipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run rollouts and print per-batch summaries")
    run.add_argument("--config", type=Path, help="YAML file of PipelineConfig fields")
    run.add_argument("--env", help="environment name (frozenlake, sokoban, ...)")
    run.add_argument(
        "--model",
        type=Path,
        help="local HF causal LM (default: the shipped warm start; 'tiny': the random tiny model)",
    )
    run.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    run.add_argument(
        "--engines",
        type=int,
        default=1,
        help="vLLM engines behind one pool (default 1); more than 1 runs each in its own "
        "process, so they compute in parallel",
    )
    run.add_argument(
        "--ray",
        action="store_true",
        help="host the vLLM engines in Ray actors (a local cluster is started on demand)",
    )
    run.add_argument("--ray-address", help="join this Ray cluster (implies --ray)")
    run.add_argument(
        "--server", help="generate with a running vLLM server at this URL (http://host:port)"
    )
    run.add_argument("--batches", type=int, default=3, help="batches to collect (default 3)")
    run.add_argument("--batch-size", type=int, help="trajectories per batch")
    run.add_argument("--group-size", type=int, help="trajectories per GRPO group")
    run.add_argument("--concurrency", type=int, help="episodes in flight at once")
    run.add_argument("--seed", type=int, help="the seed every episode derives from")
    run.add_argument("--max-turns", type=int, help="turns per episode")
    run.add_argument("--out", type=Path, help="save each batch and a JSONL of trajectories here")

    train = sub.add_parser("train", help="GRPO from the warm start on CPU, with a learning curve")
    add_train_arguments(train)

    inspect = sub.add_parser("inspect", help="describe a saved batch and decode one row")
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--row", type=int, default=0)
    inspect.add_argument("--model", type=Path, help="tokenizer to decode with")
    return parser


def load_config(args: argparse.Namespace) -> PipelineConfig:
    """YAML file, then flags on top; unknown keys and bad values name themselves."""
    data: dict[str, Any] = {}
    if args.config is not None:
        loaded = yaml.safe_load(args.config.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(
                f"--config {args.config}: expected a mapping of fields, got {type(loaded).__name__}"
            )
        data = dict(loaded or {})
    for flag, field in CONFIG_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            data[field] = value
    return PipelineConfig.from_dict(data)


def make_engine(
    kind: str,
    model_path: Path,
    engines: int = 1,
    *,
    ray_address: str | None = None,
    use_ray: bool = False,
    server: str | None = None,
) -> Any:
    """The engine ``rollpipe run`` drives: a vLLM server, one local engine, Ray actors, or
    an ``EnginePool`` of several (local ones each with its engine core in a process of
    its own: in-process CPU engines cannot compute at the same time)."""
    if engines < 1:
        raise ValueError(f"--engines must be >= 1, got {engines}")
    if server is not None:
        if engines > 1 or use_ray or ray_address:
            raise ValueError("--server takes no --engines, --ray or --ray-address")
        from rollpipe.engines.server import ServerEngine

        return ServerEngine(server)
    if kind == "hf":
        if engines > 1 or use_ray or ray_address:
            raise ValueError("--engines > 1, --ray and --ray-address need --engine vllm")
        from rollpipe.engines.hf import HFEngine

        return HFEngine(model_path)
    from rollpipe.engines.vllm import VLLMEngine

    if use_ray or ray_address:
        import functools

        import ray

        from rollpipe.engines.ray_engine import RayEngine, ray_pool

        ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False)
        make = functools.partial(VLLMEngine, str(model_path))
        return RayEngine(make) if engines == 1 else ray_pool(make, engines)
    if engines == 1:
        return VLLMEngine(model_path)
    from rollpipe.engines.pool import EnginePool

    return EnginePool.vllm(model_path, engines, multiprocess=True)


def summary_row(index: int, metrics: dict[str, float]) -> list[str]:
    return [
        str(index),
        f"{metrics['trajectories']:.0f}",
        f"{metrics['episode_score/mean']:.3f}",
        f"{metrics['success_rate']:.2f}",
        f"{metrics['turns/mean']:.2f}",
        f"{metrics['generated_tokens']:.0f}",
        f"{metrics['throughput/tokens_per_s']:.0f}",
        f"{metrics['time/wall_s']:.2f}",
    ]


def run(args: argparse.Namespace, console: Console) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the summary readable
    warnings.filterwarnings("ignore", category=FutureWarning)
    from torchdata.nodes import Mapper
    from transformers import AutoTokenizer

    from rollpipe.data.readable import decode_row
    from rollpipe.pipeline import RolloutPipeline
    from rollpipe.training.tiny_model import default_model_path
    from rollpipe.training.warm_start import warm_start_model_path

    config = load_config(args)
    if args.batches < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches}")
    if args.model is None:
        model_path = warm_start_model_path()
    elif str(args.model) == "tiny":
        console.print("[dim]building/loading the tiny local model...[/dim]")
        model_path = default_model_path()
    else:
        model_path = args.model
    if not Path(model_path).is_dir():
        raise ValueError(f"--model {model_path}: not a directory holding a HF model")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    many = args.engines > 1
    what = f"{args.engines} {args.engine} engines" if many else f"the {args.engine} engine"
    where = " in Ray actors" if args.ray or args.ray_address else ""
    if args.server:
        what, where = "a client of the vLLM server", f" at {args.server}"
    console.print(f"[dim]starting {what}{where} on {model_path}...[/dim]")
    engine = make_engine(
        args.engine,
        Path(model_path),
        args.engines,
        ray_address=args.ray_address,
        use_ray=args.ray,
        server=args.server,
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)

    table = Table(title=f"rollpipe run: {config.envs[0].label}, {args.engine}, seed {config.seed}")
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="right")
    progress = Progress(
        TextColumn("[bold]rollouts"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens_per_s]:>7.0f} tok/s"),
        TextColumn("filtered {task.fields[filtered]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task(
        "rollouts", total=args.batches * config.batch_size, tokens_per_s=0.0, filtered=0
    )
    started = time.perf_counter()
    generated = [0]

    def count(traj: Any) -> Any:
        generated[0] += traj.num_generated_tokens
        elapsed = max(time.perf_counter() - started, 1e-9)
        progress.update(
            task,
            advance=1,
            tokens_per_s=generated[0] / elapsed,
            filtered=sum(
                n for kind, n in pipe.nodes.groups.total_drops.items() if kind != "wasted_tokens"
            ),
        )
        return traj

    totals = {
        "rows": 0.0,
        "score": 0.0,
        "success": 0.0,
        "turns": 0.0,
        "tokens": 0.0,
        "wait": 0.0,  # seconds spent inside get_batch
    }
    with (
        RolloutPipeline(
            config,
            engine,
            tokenizer,
            owns_engine=True,
            hooks={"rollout": lambda node: Mapper(node, count)},
        ) as pipe,
        progress,
    ):
        for index in range(args.batches):
            batch = pipe.get_batch()
            if batch is None:
                break
            metrics = batch.meta_info["metrics"]
            table.add_row(*summary_row(index, metrics))
            rows = metrics["trajectories"]
            totals["rows"] += rows
            totals["score"] += metrics["episode_score/mean"] * rows
            totals["success"] += metrics["success_rate"] * rows
            totals["turns"] += metrics["turns/mean"] * rows
            totals["tokens"] += metrics["generated_tokens"]
            totals["wait"] += metrics["time/wall_s"]
            if args.out is not None:
                batch.meta_info["model_path"] = str(model_path)
                batch.save(args.out / f"batch_{index:04d}.pt")
                with (args.out / "trajectories.jsonl").open("a") as f:
                    for i in range(len(batch)):
                        f.write(json.dumps(decode_row(batch, i, tokenizer)) + "\n")
    wall = time.perf_counter() - started
    n = max(totals["rows"], 1.0)
    table.add_section()
    table.add_row(
        "total",
        f"{totals['rows']:.0f}",
        f"{totals['score'] / n:.3f}",
        f"{totals['success'] / n:.2f}",
        f"{totals['turns'] / n:.2f}",
        f"{totals['tokens']:.0f}",
        f"{totals['tokens'] / max(totals['wait'], 1e-9):.0f}",
        f"{totals['wait']:.2f}",
    )
    table.caption = f"The run took {wall:.1f} s, the pipeline's start-up included."
    console.print(table)
    for line in LEGEND:
        console.print(line, style="dim", highlight=False, markup=False)
    if args.out is not None:
        console.print(f"saved batches and trajectories.jsonl to {args.out}")
    return 0


def inspect(args: argparse.Namespace, console: Console) -> int:
    from transformers import AutoTokenizer

    from rollpipe.data.proto import DataProto
    from rollpipe.data.readable import show_row

    batch = DataProto.load(args.file)
    shapes = Table(title=f"{args.file}: {len(batch)} rows")
    for column in ("field", "kind", "shape / length", "dtype"):
        shapes.add_column(column)
    for key, value in batch.batch.items() if batch.batch is not None else []:
        shapes.add_row(
            key, "tensor", str(tuple(value.shape)), str(value.dtype).removeprefix("torch.")
        )
    for key, array in batch.non_tensor_batch.items():
        shapes.add_row(
            key, "non-tensor", str(len(array)), type(array[0]).__name__ if len(array) else "-"
        )
    console.print(shapes)
    if not 0 <= args.row < len(batch):
        raise ValueError(f"--row {args.row} is out of range for a batch of {len(batch)} rows")
    model_path = args.model or batch.meta_info.get("model_path")
    if model_path is None:
        from rollpipe.training.tiny_model import default_model_path

        model_path = default_model_path()
    console.print("response spans are marked [[like this]]:", style="dim")
    shown = show_row(batch, args.row, AutoTokenizer.from_pretrained(model_path))
    console.print(shown, markup=False, highlight=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        if args.command == "train":
            train_from_args(args, console)
            return 0
        return run(args, console) if args.command == "run" else inspect(args, console)
    except (ValueError, FileNotFoundError, EngineError) as error:
        console.print(f"[bold red]error:[/bold red] {error}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
