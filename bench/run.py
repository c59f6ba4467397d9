"""Run the benchmarks: ``python -m bench.run [--smoke | --quick] [--only a,b] [--repeats N]``.

``--smoke`` runs the smallest case of every benchmark once and writes nothing: it proves
that each benchmark still runs (CI runs it), its figures mean nothing.

Prints one table, writes ``bench/results/latest.json`` (one flat object; a run of some
benchmarks with ``--only`` updates theirs and keeps the rest, ``run_<name>`` naming the
run each came from), ``bench/results/latest.md`` (the table, for docs/performance.md) and a dated
copy ``bench/results/<date>[-quick].json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from bench.common import (
    BenchContext,
    Figures,
    machine_info,
    make_engine,
    rounded,
    today,
    warm_up,
)

RESULTS = Path(__file__).resolve().parent / "results"
# Order matters for memory: collate (hundreds of MB of records) runs last so it cannot
# inflate the RSS figures of the engine benchmarks.
BENCHMARKS = (
    "efficiency",
    "long_tail",
    "concurrency",
    "pause",
    "overhead",
    "collate",
    "on_policy",
    "staleness",
    "pool",
    "remote",
    "learning",
    "turn_cost",
    "tool_turn",
    "frontdoor",
    "image_turn",
    "fault_campaign",
    "node_loss",
    "weight_sync",
    "episode_workers",
)
NEEDS_ENGINE = {
    "efficiency",
    "long_tail",
    "concurrency",
    "pause",
    "overhead",
    "on_policy",
    "staleness",
    "frontdoor",
}
LEVELS = (1, 8, 64, 256)

# (label, JSON key, target text, format)
SUMMARY = (
    ("1", "Pipeline efficiency, FrozenLake", "efficiency_frozenlake", "≥ 0.9", "{:.2f}"),
    ("1", "Pipeline efficiency, Sokoban", "efficiency_sokoban", "≥ 0.9", "{:.2f}"),
    ("2", "Long tail: rollpipe ÷ lockstep traj/s", "long_tail_speedup", "≥ 2×", "{:.2f}×"),
    ("3", "Collate time ÷ torch.cat time", "collate_vs_memcpy", "≤ 2", "{:.2f}"),
    ("3", "Per-row concat time ÷ collate time", "collate_speedup_vs_concat", "≥ 5×", "{:.2f}×"),
    ("4", "suspend() to quiescence, 64 in flight", "pause_ms", "—", "{:.1f} ms"),
    ("4", "Weight sync, tiny model", "weight_sync_ms", "—", "{:.1f} ms"),
    ("4", "resume() to first new token", "resume_first_token_ms", "—", "{:.1f} ms"),
    ("6", "CPU in rollpipe per trajectory", "overhead_cpu_ms_per_trajectory", "—", "{:.2f} ms"),
    (
        "7",
        "On-policy (ratio 0): trajectories/s",
        "on_policy_ratio0_trajectories_per_s",
        "—",
        "{:.1f}",
    ),
    (
        "7",
        "On-policy (ratio 0): wasted tokens/batch",
        "on_policy_ratio0_wasted_tokens_per_batch",
        "—",
        "{:.0f}",
    ),
    ("7", "Async (ratio 1): trajectories/s", "on_policy_ratio1_trajectories_per_s", "—", "{:.1f}"),
    (
        "7",
        "Async (ratio 1): wasted tokens/batch",
        "on_policy_ratio1_wasted_tokens_per_batch",
        "—",
        "{:.0f}",
    ),
    ("13", "Staleness drop: trajectories/s", "staleness_drop_trajectories_per_s", "—", "{:.1f}"),
    ("13", "Staleness wait: trajectories/s", "staleness_wait_trajectories_per_s", "—", "{:.1f}"),
    ("13", "Staleness drop: tokens wasted", "staleness_drop_wasted_share", "—", "{:.3f}"),
    ("13", "Staleness wait: tokens wasted", "staleness_wait_wasted_share", "—", "{:.3f}"),
    (
        "13",
        "Staleness wait ÷ drop trajectories/s",
        "staleness_wait_vs_drop_trajectories",
        "—",
        "{:.2f}×",
    ),
    ("8", "Pool: sticky ÷ random routing tokens/s", "pool_sticky_vs_random", "—", "{:.2f}×"),
    (
        "8",
        "Pool: least requests ÷ least tokens tokens/s",
        "pool_requests_vs_tokens",
        "—",
        "{:.2f}×",
    ),
    ("8", "Pool: prefix-cache hit rate, sticky", "pool_sticky_prefix_hit_rate", "—", "{:.2f}"),
    ("8", "Pool: prefix-cache hit rate, random", "pool_random_prefix_hit_rate", "—", "{:.2f}"),
    ("8", "Pool: shrink 1 of 2 ranks mid-batch", "pool_shrink_ms", "—", "{:.0f} ms"),
    ("8", "Pool: expand (rebuild + load weights)", "pool_expand_load_ms", "—", "{:.0f} ms"),
    ("8", "Pool: longest request spanning a shrink", "pool_shrink_stall_ms", "—", "{:.0f} ms"),
    ("8", "Pool: 2 ÷ 1 engines, in-process", "pool_inproc_ratio", "—", "{:.2f}×"),
    ("8", "Pool: 2 ÷ 1 engines, multiprocess", "pool_multiprocess_ratio", "—", "{:.2f}×"),
    (
        "8",
        "Pool: cores used by 2 multiprocess engines (driver: next row)",
        "pool_multiprocess_2_engine_cores",
        "—",
        "{:.2f}",
    ),
    ("8", "Pool: cores used by the driver", "pool_multiprocess_2_driver_cores", "—", "{:.2f}"),
    ("8", "Pool: one engine, 16 ÷ 32 requests at once", "pool_engine_16_vs_32", "—", "{:.2f}×"),
    ("9", "RayEngine ÷ in-process tokens/s", "remote_ray_ratio", "—", "{:.2f}×"),
    ("9", "ServerEngine ÷ in-process tokens/s", "remote_server_ratio", "—", "{:.2f}×"),
    ("9", "Payload across the process boundary", "remote_bytes_per_batch", "—", "{:.0f} B/batch"),
    ("9", "Weight sync through Ray, tiny model", "remote_ray_weight_sync_ms", "—", "{:.0f} ms"),
    ("9", "Object store put + read, one node", "remote_object_store_gb_per_s", "—", "{:.2f} GB/s"),
    ("9", "Weight sync, 7B bf16 (estimate)", "remote_weight_sync_7b_s", "—", "{:.0f} s"),
    ("10", "Warm start: held-out success, greedy", "warm_start_success", "≥ 0.5", "{:.2f}"),
    ("10", "Random valid action: same seeds", "random_valid_success", "—", "{:.2f}"),
    ("10", "Warm start build time (recorded)", "warm_start_build_s", "—", "{:.0f} s"),
    ("10", "GRPO held-out success gain (median)", "grpo_success_gain", "≥ 0.07", "{:+.3f}"),
    ("10", "GRPO steps / minutes per run", "grpo_minutes", "—", "{:.1f} min"),
    ("10", "GRPO gain, lookup tool task (median)", "grpo_gain/lookup", "≥ 0.10", "{:+.3f}"),
    (
        "10",
        "lookup after GRPO, tool's answers taken away",
        "grpo_without_tool/lookup",
        "—",
        "{:.3f}",
    ),
    (
        "10",
        "GRPO gain, openai-client agent (median)",
        "grpo_gain/lookup-agent",
        "≥ 0.10",
        "{:+.3f}",
    ),
    ("10", "GRPO gain, prompt dataset sums (median)", "grpo_gain/sums", "≥ 0.10", "{:+.3f}"),
    ("10", "|infer − trainer| log-prob, fp32 mean", "logprob_gap_mean", "—", "{:.2e}"),
    ("10", "|infer − trainer| log-prob, fp32 max", "logprob_gap_max", "—", "{:.2e}"),
    ("10", "|infer − trainer| log-prob, bf16 mean", "logprob_gap_bf16_mean", "—", "{:.2e}"),
    ("10", "|infer − trainer| log-prob, bf16 max", "logprob_gap_bf16_max", "—", "{:.2e}"),
    ("10", "Trainer pass: plain ÷ shared prefix", "trainer_shared_prefix_speedup", "—", "{:.2f}×"),
    ("11", "CPU per turn, 8 turns/episode", "turn_cpu_us_8turns", "—", "{:.0f} µs"),
    ("11", "CPU per turn, 128 turns/episode", "turn_cpu_us_128turns", "—", "{:.0f} µs"),
    ("11", "CPU per turn, 1024 episodes in flight", "turn_cpu_us_1024inflight", "—", "{:.0f} µs"),
    ("11", "CPU per turn, 128 ÷ 32 turns/episode", "turn_cpu_ratio_128_32", "≤ 1.2", "{:.2f}×"),
    ("11", "Wall turns/s, 128 ÷ 32 turns/episode", "turns_per_s_ratio_128_32", "≥ 0.8", "{:.2f}×"),
    (
        "11",
        "Turns per CPU second, 1024 in flight",
        "turns_per_cpu_s_1024inflight",
        "≥ 10000",
        "{:.0f}",
    ),
    ("11", "Fixed CPU per episode", "episode_fixed_cpu_us", "—", "{:.0f} µs"),
    ("12", "Front door ÷ in-process calls/s, 32 callers", "frontdoor_calls_ratio", "—", "{:.2f}×"),
    ("12", "Front door added latency per call", "frontdoor_added_latency_ms", "—", "{:.1f} ms"),
    (
        "12",
        "Streamed call: first chunk ÷ whole unstreamed call",
        "stream_first_over_unstreamed",
        "—",
        "{:.2f}×",
    ),
    (
        "12",
        "Agent episode ÷ text episode traj/s",
        "agent_vs_text_trajectories_ratio",
        "—",
        "{:.2f}×",
    ),
    ("11", "CPU per tool turn, 8 turns/episode", "tool_turn_cpu_us_8turns", "—", "{:.0f} µs"),
    ("11", "CPU per tool turn, 32 turns/episode", "tool_turn_cpu_us_32turns", "—", "{:.0f} µs"),
    ("11", "CPU per tool turn, 128 turns/episode", "tool_turn_cpu_us_128turns", "—", "{:.0f} µs"),
    ("11", "Tool turn CPU: 128 ÷ 32 turns", "tool_turn_cpu_128_over_32", "≤ 1.2", "{:.2f}×"),
    ("14", "CPU per image turn, 8 turns/episode", "image_turn_cpu_us_8turns", "—", "{:.0f} µs"),
    ("14", "CPU per image turn, 64 turns/episode", "image_turn_cpu_us_64turns", "—", "{:.0f} µs"),
    (
        "14",
        "CPU per text turn, 64 turns/episode",
        "chat_turn_cpu_us_64turns",
        "—",
        "{:.0f} µs",
    ),
    ("14", "Image turn CPU: 64 ÷ 8 turns", "image_turn_cpu_64_over_8", "flat", "{:.2f}×"),
    ("14", "Images/s through the pipeline, tiny VLM", "pipeline_images_per_s", "—", "{:.1f}"),
    ("15", "Fault campaign: random fault points", "fault_campaign_points", "—", "{:.0f}"),
    (
        "15",
        "Fault campaign: lost + duplicated + hangs",
        "fault_campaign_failures",
        "0",
        "{:.0f}",
    ),
    (
        "14",
        "Image turns/s through the pipeline, tiny VLM",
        "pipeline_image_turns_per_s",
        "—",
        "{:.1f}",
    ),
    (
        "18",
        "Driver CPU per text turn, 2 episode workers ÷ 0",
        "driver_cpu_text_2w_over_0w",
        "—",
        "{:.2f}×",
    ),
    (
        "18",
        "Driver CPU per tool turn, 2 episode workers ÷ 0",
        "driver_cpu_tool_2w_over_0w",
        "—",
        "{:.2f}×",
    ),
    (
        "18",
        "Driver CPU per agent call, 2 episode workers ÷ 0",
        "driver_cpu_agent_2w_over_0w",
        "—",
        "{:.2f}×",
    ),
    (
        "18",
        "256 agents: calls/s on 2 workers ÷ in-process",
        "agent_calls_per_s_2w_over_0w",
        "—",
        "{:.2f}×",
    ),
    ("16", "Node lost mid-batch: batch time ÷ without", "node_loss_ratio", "—", "{:.2f}×"),
    ("16", "Node lost mid-batch: death to batch", "node_loss_death_to_batch_s", "—", "{:.1f} s"),
    ("16", "Batch without a node lost (same run)", "node_loss_batch_s", "—", "{:.1f} s"),
    (
        "17",
        "Weight sync 500 MB: broadcast ÷ object store MB/s",
        "weight_sync_broadcast_over_object_store_500mb",
        "—",
        "{:.2f}×",
    ),
    (
        "17",
        "Weight sync 7B by broadcast (projected)",
        "weight_sync_broadcast_7b_s",
        "—",
        "{:.1f} s",
    ),
    (
        "17",
        "Weight sync 7B via object store (projected)",
        "weight_sync_object_store_7b_s",
        "—",
        "{:.1f} s",
    ),
)


def _fmt(figures: Figures, key: str, fmt: str) -> str:
    value = figures.get(key)
    if value is None:
        return "—"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value)


def table(figures: Figures) -> str:
    """The results as Markdown: the summary table, then the concurrency table."""
    lines = [
        f"**Machine:** {figures.get('machine', '?')}  ",
        f"**Date:** {figures.get('date', '?')} · **Command:** `{figures.get('command', '?')}`"
        f" · **Repeats:** {figures.get('repeats', '?')} (medians)",
        "",
        *(
            [
                "**Smoke run:** each benchmark's smallest case, once; the figures only show "
                "that it runs.",
                "",
            ]
            if figures.get("mode") == "smoke"
            else []
        ),
        "| # | Benchmark | Figure (JSON key) | Target | Result |",
        "|---|---|---|---|---|",
    ]
    for num, label, key, target, fmt in SUMMARY:
        lines.append(f"| {num} | {label} | `{key}` | {target} | {_fmt(figures, key, fmt)} |")
    lines += [
        "",
        "| Concurrent episodes | Generated tokens/s | Trajectories/s | Peak RSS (MB) |",
        "|---|---|---|---|",
    ]
    for c in LEVELS:
        p = f"concurrency_{c}"
        lines.append(
            f"| {c} | {_fmt(figures, p + '_tokens_per_s', '{:.0f}')} | "
            f"{_fmt(figures, p + '_trajectories_per_s', '{:.2f}')} | "
            f"{_fmt(figures, p + '_peak_rss_mb', '{:.0f}')} |"
        )
    return "\n".join(lines) + "\n"


def merged_with_latest(figures: Figures, out_dir: Path) -> Figures:
    """A run of some benchmarks (``--only``) on top of ``latest.json``: the others keep
    their figures, and each benchmark's ``run_<name>`` says which run it came from."""
    try:
        previous = json.loads((out_dir / "latest.json").read_text())
    except (OSError, ValueError):
        return figures
    return {**previous, **figures} if isinstance(previous, dict) else figures


def write_results(figures: Figures, out_dir: Path, quick: bool) -> list[Path]:
    """latest.json, latest.md and the dated copy; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(figures, indent=2, sort_keys=True) + "\n"
    dated = out_dir / f"{datetime.now():%Y-%m-%d}{'-quick' if quick else ''}.json"
    paths = [out_dir / "latest.json", dated, out_dir / "latest.md"]
    for path, content in zip(paths, (text, text, table(figures)), strict=True):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(content)
        tmp.replace(path)
    return paths


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small workloads (< 10 min)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest case of each benchmark, once, writing nothing (CI: does it run?)",
    )
    parser.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help=f"comma-separated subset of {','.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repeats per figure (>= 1); default 5 for efficiency and long_tail, 3 for the rest",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where results go")
    parser.add_argument("--no-write", action="store_true", help="print only, write nothing")
    args = parser.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"--only: unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    args.only = [b for b in BENCHMARKS if b in chosen]
    if args.smoke:
        args.quick, args.no_write, args.repeats = True, True, 1
    return args


def main(argv: Sequence[str] | None = None) -> Figures:
    args = parse_args(argv)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    from transformers import AutoTokenizer

    from rollpipe.training.tiny_model import default_model_path

    figures: Figures = {
        "machine": machine_info(),
        "date": today(),
        "command": "python -m bench.run"
        + (" --smoke" if args.smoke else " --quick" if args.quick else ""),
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "repeats": args.repeats or "5 (efficiency, long tail), 3 (others)",
    }
    model_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    engine = None
    if NEEDS_ENGINE & set(args.only):
        log("starting the engine")
        engine = make_engine(model_path)
        warm_up(engine)
    ctx = BenchContext(
        engine,
        tokenizer,
        model_path,
        args.quick,
        args.repeats,
        log,
        results_dir=None if args.no_write else args.out_dir,
        smoke=args.smoke,
    )
    try:
        for name in args.only:
            log(f"benchmark {name}")
            t0 = time.perf_counter()
            module = importlib.import_module(f"bench.{name}")
            figures.update(module.run(ctx))
            figures[f"time_{name}_s"] = rounded(time.perf_counter() - t0)
            figures[f"run_{name}"] = f"{figures['date']} {figures['command']}"
            gc.collect()
    finally:
        if engine is not None:
            engine.close()
    figures["total_s"] = rounded(time.perf_counter() - start)
    print()
    print(table(figures))
    if not args.no_write:
        if set(args.only) != set(BENCHMARKS):
            figures = merged_with_latest(figures, args.out_dir)
        for path in write_results(figures, args.out_dir, args.quick):
            log(f"wrote {path}")
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
