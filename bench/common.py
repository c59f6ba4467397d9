"""Shared benchmark helpers: timing, medians, peak RSS sampling, machine info, the engine.

Every benchmark module exposes ``run(ctx: BenchContext) -> dict[str, float | int | str]``
returning flat figures; ``bench.run`` merges them into one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import psutil

from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import Generation, SamplingParams

Figures = dict[str, float | int | str | bool]
T = TypeVar("T")

# VLLMEngine itself turns chunked prefill off on CPU (vLLM's chunked prefill with
# per-request seeds fails there), so the bench passes only what it needs on top:
# max_num_seqs=256 lets 256 episodes really run at once (vLLM's CPU default is 128),
# which the concurrency benchmark needs.
ENGINE_KWARGS: dict[str, Any] = {"max_num_seqs": 256}


@attrs.define
class BenchContext:
    """What every benchmark gets: the shared engine, its tokenizer, and the run mode.

    ``engine`` may be None for benchmarks that need none (collation); reading it then
    raises.
    """

    _engine: Engine | None
    tokenizer: Any
    model_path: Path
    quick: bool = True
    repeats: int | None = None  # None: each benchmark's own default (``repeats_for``)
    log: Callable[[str], None] = attrs.field(default=print)
    results_dir: Path | None = None  # where side reports go (None: nowhere)
    smoke: bool = False  # the smallest case of each benchmark: does it run at all?

    def __attrs_post_init__(self) -> None:
        if self.repeats is not None and self.repeats < 1:
            raise ValueError(f"BenchContext.repeats must be >= 1 or None, got {self.repeats}")

    def repeats_for(self, default: int = 3) -> int:
        """Repeats of a benchmark: ``repeats`` when given, else its ``default`` (the
        ratios judged against a target near 1 take 5: their repeats vary most); one in
        a smoke run."""
        if self.smoke:
            return 1
        return default if self.repeats is None else self.repeats

    def size(self, *, smoke: T, quick: T, full: T) -> T:
        """A workload size by run mode: ``--smoke`` (seconds: proves the benchmark
        runs), ``--quick`` (minutes) or the full run."""
        return smoke if self.smoke else quick if self.quick else full

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("BenchContext.engine is None; this benchmark needs an engine")
        return self._engine


@contextlib.contextmanager
def one_torch_thread() -> Any:
    """Torch on one intra-op thread while the block runs (restored after): a figure of
    what one core does (two threads on a busy two-core box spin OpenMP in tensor fills)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (a ValueError naming the problem when empty)."""
    if not values:
        raise ValueError("median of no values: the benchmark produced no samples")
    return float(statistics.median(values))


def rounded(value: float, digits: int = 3) -> float:
    """Figures for the JSON: a few significant digits, so diffs stay readable."""
    if value == 0 or value != value:  # zero or NaN
        return float(value)
    from math import floor, log10

    return round(value, max(0, digits - 1 - floor(log10(abs(value)))))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, by ``time.perf_counter``."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class PeakRSS:
    """Samples this process's resident set size in a thread; ``peak_mb`` after exit.

    ``ru_maxrss`` is a lifetime high-water mark, so it cannot tell one phase of a run
    from the next; sampling current RSS every ``interval_s`` can.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_mb = 0.0
        self.peak_mb = 0.0

    def _sample(self) -> float:
        return self._proc.memory_info().rss / 2**20

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mb = max(self.peak_mb, self._sample())

    def __enter__(self) -> PeakRSS:
        self.start_mb = self.peak_mb = self._sample()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_mb = max(self.peak_mb, self._sample())


def generate_each(
    engine: Engine, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
) -> list[Generation]:
    """One batched call with per-request params: all submitted at once, wait for all.

    ``generate_batch`` with one ``SamplingParams`` per prompt (the engine's own
    ``generate_batch`` does exactly this with one shared params object).
    """
    if len(prompts) != len(params):
        raise ValueError(f"generate_each: {len(prompts)} prompts but {len(params)} params")

    async def all_at_once() -> list[Generation]:
        return list(
            await asyncio.gather(
                *(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True))
            )
        )

    return asyncio.run(all_at_once())


def reset_prefix_cache(engine: Engine) -> bool:
    """Empty vLLM's prefix cache so one arm of a comparison cannot reuse the other's KV.

    Bench-only use of ``VLLMEngine`` internals (its in-process ``LLMEngine``), run on
    the engine's own loop thread between steps. Returns False for other engines.
    """
    backend = getattr(engine, "_backend", None)
    llm = getattr(backend, "llm", None)
    call = getattr(engine, "_call", None)
    if llm is None or call is None or not hasattr(llm, "reset_prefix_cache"):
        return False

    async def reset() -> bool:
        return bool(llm.reset_prefix_cache())

    return bool(call(reset()))


def capture_hook(sink: list[Any]) -> Callable[[Any], Any]:
    """A ``build_nodes`` hook that records every item passing a stage (inline Mapper)."""
    from torchdata.nodes import Mapper

    def keep(item: Any) -> Any:
        sink.append(item)
        return item

    return lambda node: Mapper(node, keep)


def machine_info() -> str:
    """CPU model, usable cores, RAM, load and library versions, in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ram = psutil.virtual_memory().total / 2**30
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    versions = []
    for name in ("torch", "vllm"):
        try:
            module = __import__(name)
            versions.append(f"{name} {module.__version__}")
        except Exception:  # an optional library that is absent or broken
            versions.append(f"{name} n/a")
    return (
        f"{cpu}, {cores} cores, {ram:.0f} GiB RAM, load {load:.1f} at start, "
        f"Python {platform.python_version()}, {', '.join(versions)}"
    )


def today() -> str:
    return _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def make_engine(model_path: Path | str, **overrides: Any) -> Engine:
    """The benchmark engine: in-process vLLM on the tiny model (see ``ENGINE_KWARGS``)."""
    from rollpipe.engines.vllm import VLLMEngine

    return VLLMEngine(model_path, **(ENGINE_KWARGS | overrides))


def warm_up(engine: Engine, sizes: Sequence[int] = (1, 8, 64)) -> None:
    """Run a few batches so first-call costs stay out of the measurements."""
    for n in sizes:
        engine.generate_batch(
            [[5 + i % 7] * 64 for i in range(n)],
            SamplingParams(max_tokens=8, ignore_eos=True, seed=1),
        )
