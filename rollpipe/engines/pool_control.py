"""PoolControl: an ``EnginePool``'s control calls, which fan out to its ranks.

``pause`` / ``resume`` / ``update_weights`` reach every active rank; ``shrink`` /
``expand`` (ROLL's ``shrink_sampler`` / ``expand_sampler``) take ranks out of the pool
and bring them back (``pool.py`` describes both). Each blocks its caller and runs under
the pool's lock, one at a time, from any thread, while requests are in flight.
``EnginePool`` inherits them; this mixin only names the pool's parts it works on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rollpipe.engines.inputs import named_tensors
from rollpipe.engines.pool_ranks import Rank, RankTable, check_devices
from rollpipe.engines.protocol import Engine, PauseMode, WeightsLike
from rollpipe.engines.records import EngineError
from rollpipe.engines.state import EngineState, check_new_version, check_pause_mode

__all__ = ["PoolControl"]


class PoolControl:
    """``EnginePool``'s control calls (it inherits them): pause, resume, weight updates,
    shrink and expand, each under the pool's ``_control`` lock."""

    _state: EngineState
    _table: RankTable
    _control: threading.Lock  # one pause / resume / update / shrink / expand
    _all_devices: frozenset[int]
    _weights: list[tuple[str, torch.Tensor]] | None  # CPU copy, for expand
    _build: Callable[[int], Engine]  # make_engine(rank), checked

    def pause(self, mode: PauseMode = "abort") -> None:
        """Pause every active rank in ``mode`` (see ``Engine.pause``).

        Examples:
            >>> from rollpipe import EnginePool, ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     pool.pause("keep")
            ...     modes = [pool.engine(rank).pause_mode for rank in pool.active_ranks]
            ...     pool.resume()
            ...     modes, pool.is_paused
            (['keep', 'keep'], False)
        """
        check_pause_mode(mode)
        with self._control:
            self._state.check_open()
            was_running = self._state.pause_mode is None
            paused: list[Engine] = []
            with self._state.pausing(mode):  # the previous mode comes back if this raises
                try:
                    for engine in self._table.active_engines():
                        engine.pause(mode)
                        paused.append(engine)
                except BaseException:
                    if was_running:
                        for engine in paused:
                            with contextlib.suppress(EngineError):
                                engine.resume()
                    raise

    def resume(self) -> None:
        """Resume every active rank: requests held by ``pause`` continue.

        Examples:
            >>> from rollpipe import EnginePool, SamplingParams, ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     pool.pause()
            ...     waiting = pool.runtime.submit(pool.generate([1], SamplingParams()))
            ...     pool.resume()
            ...     waiting.result().token_ids, pool.interruptions
            ((7,), 2)
        """
        with self._control:
            self._state.check_open()
            with self._state.resuming():
                for engine in self._table.active_engines():
                    engine.resume()

    def update_weights(self, weights: WeightsLike, version: int | None = None) -> int:
        """Load ``weights`` into every active rank (one after another) and keep a CPU copy
        for ranks that come back later; returns the pool's new version. A rank whose engine
        dies during its load leaves the pool (``failures()``), as during a request; the
        update raises only if it was the last one (or for an error of the update itself).

        Examples:
            >>> from rollpipe import EnginePool, ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     new_version = pool.update_weights(torch.nn.Linear(2, 2))
            ...     new_version, [pool.engine(rank).version for rank in pool.active_ranks]
            (1, [1, 1])
        """
        check_new_version(version)
        named = named_tensors(weights)
        with self._control:
            self._state.check_open()
            with self._state.updating(version) as new_version:  # stored once all loaded
                for engine in self._table.active_engines():
                    try:
                        engine.update_weights(named, version=new_version)
                    except EngineError as error:  # a rank that died is taken out; the rest go on
                        if not self._table.failed_during_update(engine, error):
                            raise
                self._weights = [(name, t.to("cpu", copy=True)) for name, t in named]
        return new_version

    def shrink(self, target_gpus: Iterable[int]) -> dict[str, Any]:
        """Take out every rank whose devices touch ``target_gpus`` (ROLL's shrink_sampler).

        Returns ``aborted`` (their requests that were cut and re-sent elsewhere),
        ``remapped`` (sessions whose route was cleared), ``offload_ranks``,
        ``shrink_duration_ms``.

        Examples:
            >>> from rollpipe import EnginePool, ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     report = pool.shrink([1])
            ...     report["offload_ranks"], report["aborted"], pool.active_ranks
            ([1], 0, [0])
        """
        start = time.perf_counter()
        with self._control:
            self._state.check_open()
            targets = check_devices(target_gpus, self._all_devices, "shrink_sampler")
            chosen, remapped, engines = self._table.take_out(targets)
            for engine in engines:
                _abort(engine)
            # the cut requests come back as aborted (with their tokens) and are re-sent
            # before their engines close: a streamed one continues from its tokens
            aborted = self._table.wait_released(chosen, timeout=30)
            for engine in engines:
                engine.close()
        return {
            "aborted": aborted,
            "remapped": remapped,
            "offload_ranks": [r.index for r in chosen],
            "shrink_duration_ms": (time.perf_counter() - start) * 1000,
        }

    def expand(self, target_gpus: Iterable[int], skip_load: bool = False) -> dict[str, Any]:
        """Bring back every rank lying within ``target_gpus`` (ROLL's expand_sampler).

        Each is rebuilt and loaded with the pool's current weights, or with ``skip_load``
        checked to be at the pool's version already (refused otherwise). Returns
        ``load_ranks``, ``expand_duration_ms`` (and ``aborted`` / ``remapped``: 0, since
        rollpipe does not move live requests onto the new ranks; new episodes fill them).

        Examples:
            >>> from rollpipe import EnginePool, ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     _ = pool.shrink([1])
            ...     _ = pool.update_weights(torch.nn.Linear(2, 2))  # rank 1 is out: not loaded
            ...     report = pool.expand([1])  # rebuilt, then given the pool's weights
            ...     report["load_ranks"], pool.active_ranks, pool.engine(1).version
            ([1], [0, 1], 1)
        """
        start = time.perf_counter()
        with self._control:
            self._state.check_open()
            targets = check_devices(target_gpus, self._all_devices, "expand_sampler")
            chosen = self._table.to_expand(targets)
            built: list[tuple[Rank, Engine]] = []
            try:
                for rank in chosen:
                    if rank.engine is not None:  # a failed engine: free it first
                        _offload(rank.engine)
                        rank.engine = None
                    engine = self._build(rank.index)
                    built.append((rank, engine))
                    self._bring_up_to_date(rank, engine, skip_load)
                    if self._state.pause_mode is not None:
                        engine.pause(self._state.pause_mode)
            except BaseException:
                for _, engine in built:
                    _offload(engine)
                raise
            self._table.put_back(built)
        return {
            "aborted": 0,
            "remapped": 0,
            "load_ranks": [r.index for r in chosen],
            "expand_duration_ms": (time.perf_counter() - start) * 1000,
        }

    def _bring_up_to_date(self, rank: Rank, engine: Engine, skip_load: bool) -> None:
        version = self._state.version
        if skip_load or self._weights is None:
            if engine.version != version:
                how = (
                    "expand without skip_load to load the current weights"
                    if skip_load
                    else "make_engine must build the pool's current weights"
                )
                raise ValueError(
                    f"expand_sampler: {rank.describe()} is at policy version {engine.version} "
                    f"but the pool is at {version}; {how}"
                )
            return
        engine.update_weights(self._weights, version=version)


def _abort(engine: Engine) -> None:
    """End what a rank's engine runs as aborted (the pool re-sends it)."""
    with contextlib.suppress(EngineError):
        engine.pause("abort")


def _offload(engine: Engine) -> None:
    """Free a rank's engine: abort what it runs, then close it."""
    _abort(engine)
    engine.close()
