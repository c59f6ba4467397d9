"""Benchmark 6: CPU time spent in rollpipe itself per trajectory.

Where rollpipe's own work runs: three threads. The episodes' event-loop thread runs
the episode coroutines (prompt building with ``ChatFormat``, which calls the tokenizer;
turn records; admission) and, inline, the env calls, whose time inside
``rollpipe/envs/`` is excluded. The EpisodeRunner's source thread pulls episode specs from
the upstream node. The consumer thread (here the main thread) runs grouping, batching
and collation. The engine generates on its own thread, not counted, nor are the
engine's client-side calls (``rollpipe/engines/``: ``engine.generate`` validating and
submitting a request).

By default the episodes run on the engine's own runtime (``engine.runtime``). Here the
engine is seen through ``EpisodesApart``, which names a runtime of its own, so that a
thread's CPU time separates rollpipe's work from vLLM's: the code run per turn is the
same, plus a thread hop per request in ``rollpipe/engines/`` (excluded below) that the
default avoids.

Method, per repeat, on a FrozenLake pipeline (env stepped every turn), for each of the
three threads:

1. Unprofiled run: the thread's CPU time around ``get_batch`` = ``cpu`` (consumer:
   ``time.thread_time``; rollout thread: utime+stime from ``/proc/self/task/<tid>/stat``).
   Waiting (select, GIL, futures) costs no CPU time.
2. The same run under ``cProfile`` (one profiler enabled in each thread) with
   ``time.thread_time`` as its timer, so the profile counts CPU, not waiting. From it:
   ``excluded`` = time inside functions of ``rollpipe/engines/`` and ``rollpipe/envs/``
   entered from outside them (cumulative time per caller edge, so nothing counts twice).
3. Profiler correction: the profiler's own cost per profiled call is
   ``c = (profiled_total - cpu) / calls`` (same workload, same seed); each excluded
   subtree is charged ``c`` times its estimated call count (its calls plus its
   callees', split by caller).
4. ``overhead_cpu_ms_per_trajectory`` = the sum over the threads of
   ``cpu - corrected excluded``, divided by the trajectories.
   It includes the libraries rollpipe calls on its own behalf (tokenizer and Jinja for
   prompts, torch for rows, asyncio for scheduling, torchdata's node plumbing).

Also reported (same correction, as shares of ``main_cpu``): building prompts
(``rollpipe/agent/chat.py``, inclusive) and collating (``trajectory_rows`` and
``batch_metrics``, inclusive); and the top rollpipe
functions by self time, written to ``bench/results/latest_overhead.txt``.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rollpipe
from bench.common import BenchContext, Figures, median, reset_prefix_cache, rounded
from rollpipe.engines.records import SamplingParams
from rollpipe.pipeline import PipelineConfig, RolloutPipeline
from rollpipe.runtime import Runtime

ROOT = str(Path(rollpipe.__file__).resolve().parent)
EXCLUDED = (f"{ROOT}/engines/", f"{ROOT}/envs/")
REPORT_NAME = "latest_overhead.txt"

Func = tuple[str, int, str]


def _in(func: Func, prefixes: tuple[str, ...]) -> bool:
    return func[0].startswith(prefixes)


def _subtree_calls(stats: dict[Func, Any]) -> dict[Func, float]:
    """Estimated calls made inside each function's subtree (itself included), splitting a
    callee's subtree among its callers by call counts; cycles are cut."""
    callees: dict[Func, list[tuple[Func, int]]] = {}
    for func, (_cc, _nc, _tt, _ct, callers) in stats.items():
        for caller, (nc, _c, _t, _ct2) in callers.items():
            callees.setdefault(caller, []).append((func, nc))
    memo: dict[Func, float] = {}
    active: set[Func] = set()

    def calls(func: Func) -> float:
        if func in memo:
            return memo[func]
        total = float(stats[func][1]) if func in stats else 0.0
        if func in active:
            return total
        active.add(func)
        for callee, nc in callees.get(func, []):
            own = stats.get(callee, (0, 0))[1]
            if own and callee != func:
                total += nc / own * calls(callee)
        active.discard(func)
        memo[func] = total
        return total

    for func in stats:
        calls(func)
    return memo


def _inclusive(
    stats: dict[Func, Any],
    match: Callable[[Func], bool],
    per_call: float = 0.0,
    subtree: dict[Func, float] | None = None,
) -> float:
    """CPU time of the functions ``match`` accepts, entered from functions it rejects
    (per caller edge, so nothing counts twice), less ``per_call`` profiler cost for
    every call estimated to happen in those subtrees."""
    subtree = subtree or {}
    total = 0.0
    for func, (_cc, nc, _tt, _ct, callers) in stats.items():
        if not match(func):
            continue
        for caller, (edge_nc, _c, _t, ct) in callers.items():
            if not match(caller):
                share = edge_nc / nc if nc else 0.0
                total += max(0.0, ct - per_call * share * subtree.get(func, 0.0))
    return total


def _is_collation(func: Func) -> bool:
    return func[2] in ("trajectory_rows", "batch_metrics") and func[0].startswith(ROOT)


def _config(ctx: BenchContext, n: int, seed: int) -> PipelineConfig:
    return PipelineConfig(
        envs="frozenlake",
        group_size=4,
        batch_size=n,
        num_groups=n // 4,
        seed=seed,
        max_turns=4,
        concurrency=min(n, 64),
        sampling=SamplingParams(max_tokens=24),
        on_length="step",
    )


class EpisodesApart:
    """The bench engine, seen with a runtime of its own: the episodes run there (and reach
    the engine through its bridge), so their thread's CPU time is rollpipe's alone."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.runtime = Runtime("bench-episodes")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _thread_cpu(native_id: int) -> float:
    """CPU seconds (user + system) a thread of this process has used (Linux /proc)."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _enable(profile: cProfile.Profile) -> None:
    profile.enable()  # runs on the rollout's loop thread: profiles that thread


async def _disable(profile: cProfile.Profile) -> None:
    profile.disable()


def _drain(
    ctx: BenchContext, config: PipelineConfig, profiles: dict[str, cProfile.Profile] | None
) -> dict[str, float]:
    """Run the pipeline to the end; CPU seconds of the consumer, episode and source threads."""
    reset_prefix_cache(ctx.engine)
    engine = EpisodesApart(ctx.engine)
    try:
        with RolloutPipeline(config, engine, ctx.tokenizer) as pipe:  # type: ignore[arg-type]
            source_thread = pipe.nodes.rollout._source_thread  # bench reaches internals
            tids = {
                "rollout": engine.runtime.thread.native_id,
                "source": source_thread.submit(threading.get_native_id).result(),
            }
            start = time.thread_time()
            starts = {name: _thread_cpu(tid) for name, tid in tids.items()}
            if profiles is not None:
                profiles["consumer"].enable()
                engine.runtime.call(_enable(profiles["rollout"]))
                source_thread.submit(profiles["source"].enable).result()
            batch = pipe.get_batch(-1)
            if profiles is not None:
                source_thread.submit(profiles["source"].disable).result()
                engine.runtime.call(_disable(profiles["rollout"]))
                profiles["consumer"].disable()
            cpu = {"consumer": time.thread_time() - start}
            cpu.update({name: _thread_cpu(tid) - starts[name] for name, tid in tids.items()})
    finally:
        engine.runtime.close()
    if batch is None or len(batch) != config.batch_size:
        raise RuntimeError(f"overhead: pipeline returned {batch!r}")
    return cpu


def run(ctx: BenchContext) -> Figures:
    n = ctx.size(smoke=16, quick=64, full=256)
    per_traj, shares, prompt_share, collate_share, consumer = [], [], [], [], []
    last: pstats.Stats | None = None
    for rep in range(ctx.repeats_for()):
        config = _config(ctx, n, seed=rep)
        cpu = _drain(ctx, config, None)
        profiles = {name: cProfile.Profile(time.thread_time) for name in cpu}
        _drain(ctx, config, profiles)
        own = prompts = collate = 0.0
        for name, profile in profiles.items():
            stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
            total = sum(tt for (_cc, _nc, tt, _ct, _callers) in stats.values())
            n_calls = sum(nc for (_cc, nc, _tt, _ct, _callers) in stats.values())
            per_call = max(0.0, (total - cpu[name]) / n_calls) if n_calls else 0.0
            subtree = _subtree_calls(stats)
            excluded = _inclusive(stats, lambda f: _in(f, EXCLUDED), per_call, subtree)
            own += max(0.0, cpu[name] - excluded)
            prompts += _inclusive(
                stats, lambda f: f[0] == f"{ROOT}/agent/chat.py", per_call, subtree
            )
            collate += _inclusive(stats, _is_collation, per_call, subtree)
        last = pstats.Stats(profiles["rollout"]).add(profiles["consumer"], profiles["source"])
        both = sum(cpu.values())
        shares.append(own / both if both else 0.0)
        prompt_share.append(prompts / both if both else 0.0)
        collate_share.append(collate / both if both else 0.0)
        per_traj.append(1e3 * own / n)
        consumer.append(1e3 * cpu["consumer"] / n)
        ctx.log(
            f"  overhead rep {rep}: CPU {1e3 * cpu['consumer'] / n:.2f} ms/traj consumer + "
            f"{1e3 * cpu['rollout'] / n:.2f} episodes + {1e3 * cpu['source'] / n:.2f} source, "
            f"rollpipe share {shares[-1]:.2f} "
            f"(prompts {prompt_share[-1]:.2f}, collate {collate_share[-1]:.2f}) -> "
            f"{per_traj[-1]:.2f} ms/traj"
        )
    if ctx.results_dir is not None and last is not None:
        report = ctx.results_dir / REPORT_NAME
        report.parent.mkdir(parents=True, exist_ok=True)
        with report.open("w") as f:
            f.write(f"rollpipe functions by self CPU time (last repeat, {n} trajectories)\n")
            last.stream = f  # type: ignore[attr-defined]
            last.sort_stats("tottime").print_stats(ROOT, 25)
    return {
        "overhead_cpu_ms_per_trajectory": rounded(median(per_traj)),
        "overhead_consumer_cpu_ms_per_trajectory": rounded(median(consumer)),
        "overhead_rollpipe_share_of_thread_cpu": rounded(median(shares)),
        "overhead_prompt_share": rounded(median(prompt_share)),
        "overhead_collate_share": rounded(median(collate_share)),
        "overhead_trajectories": n,
    }
