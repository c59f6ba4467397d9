"""Soak: mixed faults and weight updates for a long time, on the real vLLM engine.

``python -m bench.soak --minutes 30`` (``nox -s soak -- --minutes 2``) runs pipeline
after pipeline on one engine. Every env fails now and then (raises, NaN / string rewards,
non-string observations, a short hang over a shorter ``env_timeout_s``); before each
batch a random point is drawn: nothing, a suspend (keep / abort / wait) from another
thread mid-batch with or without a weight update, or a checkpoint restored into a fresh
pipeline; every ``--cycle`` batches the pipeline is closed and a new one built.

It reports points tried, rows, lost / duplicated trajectories (must be 0: every group
whole, no trajectory twice), errors by kind, the RSS slope in MB per 1000 trajectories
(least squares over the second half of the run, after warm-up), threads after each
close against the baseline, and the sizes of rollpipe's per-group bookkeeping. Exit
status 1 if anything was lost, duplicated or left running.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import random
import threading
import time
import tracemalloc
from collections import Counter
from typing import Any, ClassVar

import attrs
import numpy as np
import psutil

from rollpipe.envs import FrozenLake, register
from rollpipe.pipeline import PipelineConfig, RolloutPipeline


class SoakLake(FrozenLake):
    """FrozenLake that fails in one of several ways on a fraction of its steps; every
    fault is logged (``injected``) with its kind and time, keyed by (seed, step)."""

    blocking = True  # a user env: calls on env threads, where a hang can time out
    kinds = ("raise", "nan_reward", "str_reward", "obs_not_str", "hang")
    injected: ClassVar[dict[tuple[int, int], list[tuple[str, float]]]] = {}
    lock = threading.Lock()
    built = 0

    def __init__(
        self, rate: float = 0.05, hang_s: float = 0.3, kinds: Any = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.rate, self.hang_s = rate, hang_s
        self.kinds = tuple(kinds or SoakLake.kinds)
        with SoakLake.lock:
            SoakLake.built += 1
            self.uid = SoakLake.built
        self.rng = random.Random(0)
        self.seed0, self.n = 0, 0

    def reset(self, seed: int) -> Any:
        self.rng.seed(f"{seed}-{self.uid}")
        self.seed0, self.n = seed, 0
        return super().reset(seed)

    def step(self, action_text: str) -> Any:
        self.n += 1
        obs, reward, term, trunc, info = super().step(action_text)
        if self.rng.random() >= self.rate:
            return obs, reward, term, trunc, info
        kind = self.rng.choice(self.kinds)
        with SoakLake.lock:
            SoakLake.injected.setdefault((self.seed0, self.n), []).append((kind, time.monotonic()))
        if kind == "raise":
            raise RuntimeError("soak: injected failure")
        if kind == "hang":
            threading.Event().wait(self.hang_s)  # blocks this env thread only
        if kind == "nan_reward":
            reward = math.nan
        if kind == "str_reward":
            reward = "1.5"
        if kind == "obs_not_str":
            obs = 7
        return obs, reward, term, trunc, info


register("soak_lake", SoakLake, overwrite=True)


HANG_S = 60.0  # a get_batch slower than this counts as a hang


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def slope_per_1000(points: list[tuple[int, float]]) -> float:
    """MB per 1000 trajectories, least squares over the second half of the run."""
    half = points[len(points) // 2 :]
    if len(half) < 3:
        return float("nan")
    x = np.array([p[0] for p in half], dtype=float)
    y = np.array([p[1] for p in half], dtype=float)
    return float(np.polyfit(x, y, 1)[0] * 1000)


def _trimmed_rss() -> float | None:
    """RSS after ``gc.collect()`` and glibc's ``malloc_trim(0)``: what is left once the
    allocator hands back the free memory it holds (None off glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return round(rss_mb(), 1)


def _python_growth(first: Any, rows: int) -> dict[str, Any]:
    """Python-level allocations grown since ``first`` (rows, snapshot), by line."""
    if first is None:
        return {}
    since_rows, snapshot = first
    stats = tracemalloc.take_snapshot().compare_to(snapshot, "lineno")
    per_1000 = 1000 / max(1, rows - since_rows)
    return {
        "kb_per_1000_traj_total": round(sum(s.size_diff for s in stats) / 1024 * per_1000, 1),
        "top_lines_kb_per_1000_traj": {
            str(s.traceback[0]): round(s.size_diff / 1024 * per_1000, 1) for s in stats[:8]
        },
    }


def suspended_batch(pipe: RolloutPipeline, mode: str, delay: float, weights: Any) -> Any:
    out: dict[str, Any] = {}

    def collect() -> None:
        try:
            out["batch"] = pipe.get_batch()
        except BaseException as e:  # reported by the caller
            out["error"] = e

    worker = threading.Thread(target=collect, name="soak-collect")
    worker.start()
    time.sleep(delay)  # a random point in the batch
    pipe.suspend(mode)  # type: ignore[arg-type]
    if weights is not None:
        pipe.update_weights(weights)
    pipe.resume()
    worker.join(120)
    if worker.is_alive():
        raise RuntimeError("get_batch hung across a suspend")
    if "error" in out:
        raise out["error"]
    return out["batch"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--cycle", type=int, default=25, help="batches per pipeline")
    parser.add_argument("--rate", type=float, default=0.05, help="faults per env step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds", default=",".join(SoakLake.kinds), help="fault kinds, comma-separated"
    )
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument(
        "--trace", action="store_true", help="tracemalloc: Python-level growth by line (slow)"
    )
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollpipe.engines.vllm import VLLMEngine
    from rollpipe.training.tiny_model import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = VLLMEngine(path, kv_cache_space_gib=1, max_model_len=1024, seed=0)
    kinds = args.kinds.split(",")
    fields = {f.name for f in attrs.fields(PipelineConfig)}
    extra = {"env_timeout_s": 0.1} if "env_timeout_s" in fields else {}
    config = PipelineConfig(
        envs=[{"name": "soak_lake", "config": {"rate": args.rate, "kinds": kinds}}],
        group_size=4,
        batch_size=16,
        max_turns=3,
        max_length=512,
        concurrency=16,
        sampling={"max_tokens": 12},
        async_generation_ratio=None,
        **extra,
    )
    rng = random.Random(args.seed)
    baseline_threads = threading.active_count()  # the engine's included
    points: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    worst: dict[str, float] = {}  # fault kind -> worst seconds from injection to report
    slow_batches = 0  # get_batch calls over HANG_S: counted as hangs
    rss: list[tuple[int, float]] = []
    rows = lost = duplicated = 0
    threads_after_close: list[int] = []
    bookkeeping: dict[str, int] = {}
    deadline = time.monotonic() + args.minutes * 60
    start_rss = rss_mb()
    if args.trace:
        tracemalloc.start(8)
    first_snapshot: Any = None
    traced_from = time.monotonic() + args.minutes * 60 / 3  # after warm-up
    cycle = 0
    while time.monotonic() < deadline:
        pipe = RolloutPipeline(config.replace(seed=cycle), engine, tokenizer)
        seen: set[int] = set()
        for _ in range(args.cycle):
            draw = rng.random()
            batch_start = time.monotonic()
            if draw < 0.35:
                mode = rng.choice(["keep", "abort", "wait"])
                update = rng.random() < 0.5
                points[f"suspend_{mode}" + ("+update" if update else "")] += 1
                batch = suspended_batch(
                    pipe, mode, rng.uniform(0, 0.1), weights if update else None
                )
            else:
                if draw < 0.5:
                    points["checkpoint"] += 1
                    state = pipe.state_dict()
                    pipe.close()
                    pipe = RolloutPipeline(config.replace(seed=cycle), engine, tokenizer)
                    pipe.load_state_dict(state)
                else:
                    points["plain"] += 1
                batch = pipe.get_batch()
            slow_batches += time.monotonic() - batch_start > HANG_S
            ids = batch.batch["traj_id"].tolist()
            groups = Counter(batch.batch["traj_group_id"].tolist())
            duplicated += len(ids) - len(set(ids)) + len(seen & set(ids))
            lost += sum(config.group_size - n for n in groups.values() if n < config.group_size)
            lost += max(0, config.batch_size - len(ids))
            seen.update(ids)
            rows += len(ids)
            now = time.monotonic()
            for e in batch.meta_info.get("env_errors", []):
                errors[e["message"].split("(", 1)[0]] += 1
                with SoakLake.lock:
                    faults = SoakLake.injected.get((e["seed"], e["turn"] + 1), [])
                for kind, at in faults[:1]:
                    worst[kind] = max(worst.get(kind, 0.0), now - at)
            rss.append((rows, rss_mb()))
            if args.trace and first_snapshot is None and time.monotonic() > traced_from:
                first_snapshot = (rows, tracemalloc.take_snapshot())
            if time.monotonic() >= deadline:
                break
        groups_node, signals = pipe.nodes.groups, pipe.nodes.signals
        bookkeeping = {
            "assembler_closed_ids": len(groups_node._closed),
            "control_cancelled_ids": len(signals._cancelled),
            "batches_in_pipeline": len(rss),
        }
        pipe.close()
        points["rebuild"] += 1
        threads_after_close.append(threading.active_count())
        cycle += 1
    python_growth = _python_growth(first_snapshot, rows) if args.trace else {}
    trimmed = _trimmed_rss()
    engine.close()
    report = {
        "minutes": args.minutes,
        "points": sum(points.values()),
        "points_by_kind": dict(points),
        "trajectories": rows,
        "lost": lost,
        "duplicated": duplicated,
        "errors_by_kind": dict(errors),
        "faults_injected_by_kind": dict(
            Counter(k for faults in SoakLake.injected.values() for k, _ in faults)
        ),
        "worst_fault_to_report_s": {k: round(v, 2) for k, v in worst.items()},
        "hangs": slow_batches,
        "rss_start_mb": round(start_rss, 1),
        "rss_end_mb": round(rss[-1][1], 1) if rss else None,
        "rss_slope_mb_per_1000_traj": round(slope_per_1000(rss), 3),
        "rss_after_gc_and_malloc_trim_mb": trimmed,
        "rss_mb_at_quarters": [
            round(rss[int(q * (len(rss) - 1))][1], 1) for q in (0, 0.25, 0.5, 0.75, 1)
        ]
        if rss
        else [],
        "threads_baseline": baseline_threads,
        "threads_after_close_max": max(threads_after_close, default=0),
        "last_pipeline_bookkeeping": bookkeeping,
        "python_growth": python_growth,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    leaked_threads = max(threads_after_close, default=0) > baseline_threads + 2
    return 1 if lost or duplicated or leaked_threads or slow_batches else 0


if __name__ == "__main__":
    raise SystemExit(main())
