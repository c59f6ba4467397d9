"""Soak: mixed faults and weight updates for a long time, on the real vLLM engine.

``python -m bench.soak --minutes 30`` (``nox -s soak -- --minutes 2``) runs pipeline
after pipeline on one engine. Every env fails now and then (raises, NaN / string rewards,
non-string observations, a hang longer than ``env_timeout_s``); before each batch a
random point is drawn: nothing, a suspend (keep / abort / wait) from another thread
mid-batch with or without a weight update, or a checkpoint restored into a fresh
pipeline; every ``--cycle`` batches the pipeline is closed and a new one built.

Every injected fault must produce its expected outcome (:data:`EXPECTED`), or the soak
fails naming the kind and its counts. Env faults are scheduled from the episode's seed
and step alone (:func:`scheduled`), so the rows say which of them each trajectory met: a
reported error must be the scheduled fault's exception type (a hang: ``EnvTimeoutError``),
a trajectory that reaches a batch whole must have met none (a hang it survived is a timeout
that never applied), and every injected kind must be reported at least once. Engine
points: an ``abort`` suspend with requests in flight aborts some (their turns are
regenerated: the batch still comes whole), ``keep`` / ``wait`` / no suspend aborts none,
and every weight update bumps the version by one.

It reports points tried, rows, lost / duplicated trajectories (must be 0: every group
whole, no trajectory twice), the fault accounting by kind, errors by kind, the RSS slope
in MB per 1000 trajectories (least squares over the second half of the run, after
warm-up), threads after each close against the baseline, and the sizes of rollpipe's
per-group bookkeeping. Exit status 1 if anything was lost, duplicated, left running or
hung, or a fault's outcome disagrees with its kind.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import math
import random
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import psutil

from rollpipe._utils.seeding import derive_seed
from rollpipe.envs import FrozenLake, register
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

EXPECTED = {
    "raise": "RuntimeError",
    "nan_reward": "EnvReturnError",
    "str_reward": "EnvReturnError",
    "obs_not_str": "EnvReturnError",
    "hang": "EnvTimeoutError",
}
"""Env fault kind -> the exception type its errored trajectory must report."""


def scheduled(seed: int, step: int, rate: float, kinds: Sequence[str]) -> str | None:
    """The fault (a kind, or None) of env step ``step`` (1-based) of an episode with
    ``seed``: the same for every group member and every run, so a row's group id and
    turn count say which faults its trajectory met."""
    digest = hashlib.blake2b(f"{seed},{step}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest[:4], "little") / 2**32
    if u >= rate:
        return None
    return kinds[int.from_bytes(digest[4:], "little") % len(kinds)]


class SoakLake(FrozenLake):
    """FrozenLake that fails at the steps :func:`scheduled` picks; every fault it
    injects is counted by kind (``injected``)."""

    blocking = True  # a user env: calls on env threads, where a hang can time out
    injected: ClassVar[Counter[str]] = Counter()
    lock = threading.Lock()

    def __init__(
        self, rate: float = 0.05, hang_s: float = 3.0, kinds: Any = None, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.rate, self.hang_s = rate, hang_s
        self.kinds = tuple(kinds or EXPECTED)
        self.seed0, self.n = 0, 0

    def reset(self, seed: int) -> Any:
        self.seed0, self.n = seed, 0
        return super().reset(seed)

    def step(self, action_text: str) -> Any:
        self.n += 1
        obs, reward, term, trunc, info = super().step(action_text)
        kind = scheduled(self.seed0, self.n, self.rate, self.kinds)
        if kind is None:
            return obs, reward, term, trunc, info
        with SoakLake.lock:
            SoakLake.injected[kind] += 1
        if kind == "raise":
            raise RuntimeError("soak: injected failure")
        if kind == "hang":
            threading.Event().wait(self.hang_s)  # blocks this env thread only
        if kind == "nan_reward":
            reward = math.nan
        if kind == "str_reward":
            reward = "1.5"  # type: ignore[assignment]
        if kind == "obs_not_str":
            obs = 7  # type: ignore[assignment]
        return obs, reward, term, trunc, info


register("soak_lake", SoakLake, overwrite=True)


class FaultAccount:
    """What each injected fault led to, read from the batches (see the module doc)."""

    def __init__(self, rate: float, kinds: Sequence[str]) -> None:
        self.rate, self.kinds = rate, tuple(kinds)
        self.reported: Counter[str] = Counter()  # errored as expected
        self.survived: Counter[str] = Counter()  # met by a trajectory that came whole
        self.wrong: Counter[str] = Counter()  # "kind -> type" reported instead
        self.aborted: Counter[str] = Counter()  # engine "abort" answers, by point
        self.abort_points_in_flight = 0  # abort suspends that found requests in flight
        self.updates = 0

    def batch(self, batch: Any, user_seed: int) -> None:
        """Count the faults this batch's rows and errors show."""
        groups = batch.batch["traj_group_id"].tolist()
        for group, scores in zip(groups, batch.non_tensor_batch["step_scores"], strict=True):
            seed = derive_seed(user_seed, group)
            for step in range(1, len(scores) + 1):
                kind = scheduled(seed, step, self.rate, self.kinds)
                if kind is not None:
                    self.survived[kind] += 1
        for e in batch.meta_info.get("env_errors", []):
            kind = scheduled(e["seed"], e["turn"] + 1, self.rate, self.kinds)
            if kind is not None and e["type"] == EXPECTED[kind]:
                self.reported[kind] += 1
            else:
                self.wrong[f"{kind} -> {e['type']}"] += 1

    def by_kind(self, injected: Counter[str]) -> dict[str, dict[str, int]]:
        return {
            kind: {
                "injected": injected[kind],
                "reported_as_expected": self.reported[kind],
                "survived_in_whole_trajectories": self.survived[kind],
            }
            for kind in self.kinds
        }

    def mismatches(self, injected: Counter[str], version_moved: int) -> list[str]:
        """One line per fault kind whose outcome disagrees with what it must do."""
        out = []
        for kind in self.kinds:
            n, seen, survived = injected[kind], self.reported[kind], self.survived[kind]
            counts = f"injected {n}, reported as {EXPECTED[kind]} {seen}, survived {survived}"
            if survived:
                out.append(f"{kind}: {survived} trajectories met it and came whole ({counts})")
            if n and not seen:
                out.append(f"{kind}: never reported as {EXPECTED[kind]} ({counts})")
        for what, n in self.wrong.items():
            out.append(f"unexpected env error {what}: {n} (a fault reported as another type)")
        for point, n in self.aborted.items():
            if not point.startswith("suspend_abort"):
                out.append(f"{point}: {n} requests aborted; only an abort suspend may abort")
        abort_total = sum(n for p, n in self.aborted.items() if p.startswith("suspend_abort"))
        if self.abort_points_in_flight >= 3 and abort_total == 0:
            out.append(
                f"suspend_abort: {self.abort_points_in_flight} suspends found requests in "
                "flight, none was aborted (the mode did not apply)"
            )
        if version_moved != self.updates:
            out.append(f"update: {self.updates} weight updates moved the version {version_moved}")
        return out


class Counted:
    """Wraps ``engine.generate`` (an instance attribute, removed by :meth:`close`): counts
    requests in flight and "abort" answers under the current ``point``."""

    def __init__(self, engine: Any, account: FaultAccount) -> None:
        self.engine, self.account = engine, account
        self.point, self.in_flight = "plain", 0
        generate = engine.generate

        async def counted(prompt_ids: Any, params: Any, **kw: Any) -> Any:
            self.in_flight += 1  # on the engine's loop: one thread
            try:
                gen = await generate(prompt_ids, params, **kw)
            finally:
                self.in_flight -= 1
            if gen.finish_reason == "abort":
                account.aborted[self.point] += 1
            return gen

        engine.generate = counted

    def close(self) -> None:
        del self.engine.generate  # the engine's own method again


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


def _threads_after(baseline: set[threading.Thread], bound_s: float) -> int:
    """Threads alive once every thread started since ``baseline`` has ended (each
    joined: an env thread still in an injected hang ends with it), within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    for thread in set(threading.enumerate()) - baseline:
        thread.join(max(0.0, deadline - time.monotonic()))
    return threading.active_count()


def suspended_batch(
    pipe: RolloutPipeline, mode: str, delay: float, weights: Any, counted: Counted
) -> Any:
    out: dict[str, Any] = {}

    def collect() -> None:
        try:
            out["batch"] = pipe.get_batch()
        except BaseException as e:  # reported by the caller
            out["error"] = e

    worker = threading.Thread(target=collect, name="soak-collect")
    worker.start()
    time.sleep(delay)  # a random point in the batch (not a wait for a state)
    if mode == "abort" and counted.in_flight:
        counted.account.abort_points_in_flight += 1
    pipe.suspend(mode)  # type: ignore[arg-type]
    if weights is not None:
        pipe.update_weights(weights)
        counted.account.updates += 1
    pipe.resume()
    worker.join(HANG_S)
    if worker.is_alive():
        raise RuntimeError(f"get_batch hung across a suspend({mode!r})")
    if "error" in out:
        raise out["error"]
    return out["batch"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--batches", type=int, default=None, help="stop after this many")
    parser.add_argument("--cycle", type=int, default=25, help="batches per pipeline")
    parser.add_argument("--rate", type=float, default=0.05, help="faults per env step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default=",".join(EXPECTED), help="fault kinds, comma-separated")
    parser.add_argument("--hang-s", type=float, default=3.0, help="how long a hang blocks")
    parser.add_argument(
        "--env-timeout-s",
        type=float,
        default=1.0,
        help="EpisodeSettings.env_timeout_s (a hang longer than it must time out)",
    )
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument(
        "--trace", action="store_true", help="tracemalloc: Python-level growth by line (slow)"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds.split(",")) - set(EXPECTED))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; choose from {list(EXPECTED)}")
    return args


def soak_config(args: argparse.Namespace) -> PipelineConfig:
    """The soak's pipeline; ``env_timeout_s`` goes to ``EpisodeSettings`` (a flat name
    routed to its section), checked to have landed there."""
    config = PipelineConfig(
        envs=[
            {
                "name": "soak_lake",
                "config": {
                    "rate": args.rate,
                    "kinds": args.kinds.split(","),
                    "hang_s": args.hang_s,
                },
            }
        ],
        group_size=4,
        batch_size=16,
        max_turns=3,
        max_length=512,
        concurrency=16,
        sampling={"max_tokens": 12},
        async_generation_ratio=None,
        env_timeout_s=args.env_timeout_s,
    )
    if config.episode.env_timeout_s != args.env_timeout_s:
        raise RuntimeError(
            f"soak: EpisodeSettings.env_timeout_s is {config.episode.env_timeout_s}, "
            f"asked {args.env_timeout_s}: the setting no longer reaches the episodes"
        )
    return config


def soak(engine: Any, tokenizer: Any, weights: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak on ``engine`` (left open) and return its report; ``report["failures"]``
    lists what went wrong (empty: passed)."""
    config = soak_config(args)
    kinds = args.kinds.split(",")
    account = FaultAccount(args.rate, kinds)
    with SoakLake.lock:
        SoakLake.injected.clear()
    version0 = engine.version
    rng = random.Random(args.seed)
    baseline = set(threading.enumerate())  # the engine's included
    baseline_threads = len(baseline)
    points: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    slow_batches = 0  # get_batch calls over HANG_S: counted as hangs
    rss: list[tuple[int, float]] = []
    rows = lost = duplicated = batches = 0
    threads_after_close: list[int] = []
    bookkeeping: dict[str, int] = {}
    deadline = time.monotonic() + args.minutes * 60
    start_rss = rss_mb()
    if args.trace:
        tracemalloc.start(8)
    first_snapshot: Any = None
    traced_from = time.monotonic() + args.minutes * 60 / 3  # after warm-up
    cycle = 0
    started = time.monotonic()
    counted = Counted(engine, account)

    def done() -> bool:
        return time.monotonic() >= deadline or (
            args.batches is not None and batches >= args.batches
        )

    try:
        while not done():
            pipe = RolloutPipeline(config.replace(seed=cycle), engine, tokenizer)
            seen: set[int] = set()
            for _ in range(args.cycle):
                draw = rng.random()
                batch_start = time.monotonic()
                if draw < 0.35:
                    mode = rng.choice(["keep", "abort", "wait"])
                    update = rng.random() < 0.5
                    counted.point = f"suspend_{mode}" + ("+update" if update else "")
                    points[counted.point] += 1
                    batch = suspended_batch(
                        pipe, mode, rng.uniform(0, 0.1), weights if update else None, counted
                    )
                else:
                    if draw < 0.5:
                        counted.point = "checkpoint"
                        state = pipe.state_dict()
                        pipe.close()
                        pipe = RolloutPipeline(config.replace(seed=cycle), engine, tokenizer)
                        pipe.load_state_dict(state)
                    else:
                        counted.point = "plain"
                    points[counted.point] += 1
                    batch = pipe.get_batch()
                batches += 1
                slow_batches += time.monotonic() - batch_start > HANG_S
                account.batch(batch, cycle)
                ids = batch.batch["traj_id"].tolist()
                groups = Counter(batch.batch["traj_group_id"].tolist())
                duplicated += len(ids) - len(set(ids)) + len(seen & set(ids))
                lost += sum(config.group_size - n for n in groups.values() if n < config.group_size)
                lost += max(0, config.batch_size - len(ids))
                seen.update(ids)
                rows += len(ids)
                for e in batch.meta_info.get("env_errors", []):
                    errors[e["type"]] += 1
                rss.append((rows, rss_mb()))
                if args.trace and first_snapshot is None and time.monotonic() > traced_from:
                    first_snapshot = (rows, tracemalloc.take_snapshot())
                if done():
                    break
            groups_node, signals = pipe.nodes.groups, pipe.nodes.signals
            bookkeeping = {
                "assembler_closed_ids": len(groups_node._closed),
                "control_cancelled_ids": len(signals._cancelled),
                "batches_in_pipeline": len(rss),
            }
            pipe.close()
            points["rebuild"] += 1
            threads_after_close.append(_threads_after(baseline, args.hang_s + HANG_S))
            cycle += 1
    finally:
        counted.close()
    python_growth = _python_growth(first_snapshot, rows) if args.trace else {}
    with SoakLake.lock:
        injected = Counter(SoakLake.injected)
    failures = account.mismatches(injected, engine.version - version0)
    leaked_threads = max(threads_after_close, default=0) > baseline_threads + 2
    failures += [f"lost {lost} trajectories"] * bool(lost)
    failures += [f"duplicated {duplicated} trajectories"] * bool(duplicated)
    failures += [f"{slow_batches} get_batch calls over {HANG_S} s (hangs)"] * bool(slow_batches)
    failures += ["threads left running after close"] * leaked_threads
    return {
        "minutes": round((time.monotonic() - started) / 60, 2),
        "env_timeout_s": config.episode.env_timeout_s,
        "hang_s": args.hang_s,
        "batches": batches,
        "points": sum(points.values()),
        "points_by_kind": dict(points),
        "trajectories": rows,
        "lost": lost,
        "duplicated": duplicated,
        "faults_by_kind": account.by_kind(injected),
        "aborted_requests_by_point": dict(account.aborted),
        "abort_suspends_with_requests_in_flight": account.abort_points_in_flight,
        "weight_updates": account.updates,
        "errors_by_type": dict(errors),
        "hangs": slow_batches,
        "rss_start_mb": round(start_rss, 1),
        "rss_end_mb": round(rss[-1][1], 1) if rss else None,
        "rss_slope_mb_per_1000_traj": round(slope_per_1000(rss), 3),
        "rss_after_gc_and_malloc_trim_mb": _trimmed_rss(),
        "rss_mb_at_quarters": [
            round(rss[int(q * (len(rss) - 1))][1], 1) for q in (0, 0.25, 0.5, 0.75, 1)
        ]
        if rss
        else [],
        "threads_baseline": baseline_threads,
        "threads_after_close_max": max(threads_after_close, default=0),
        "last_pipeline_bookkeeping": bookkeeping,
        "python_growth": python_growth,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollpipe.engines.vllm import VLLMEngine
    from rollpipe.training.tiny_model import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = VLLMEngine(path, kv_cache_space_gib=1, max_model_len=1024, seed=0)
    try:
        report = soak(engine, tokenizer, weights, args)
    finally:
        engine.close()
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    for line in report["failures"]:
        print(f"SOAK FAILED: {line}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
