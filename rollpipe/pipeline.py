"""RolloutPipeline: the ready-made chain from one config to ``DataProto`` batches: the chain
``build_nodes`` wires (``chain.py``) in a ``torchdata.nodes.Loader``, with ROLL's ``get_batch`` /
``suspend`` / ``resume`` and checkpointing. Suspension is the chain's one ``Suspension``
(``nodes/suspension.py``); docs/pausing.md has its rules.
"""

from __future__ import annotations

import itertools
import numbers
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from torchdata.nodes import Loader

from rollpipe.chain import NodeHook, PipelineNodes, Stage, build_nodes
from rollpipe.config import PipelineConfig
from rollpipe.data.proto import DataProto
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.protocol import Engine, PauseMode, WeightsLike
from rollpipe.envs.pool import EnvForSpec
from rollpipe.nodes.closing import close_chain
from rollpipe.nodes.suspension import DEFAULT_MODE, Suspension
from rollpipe.runtime import RuntimeClosedError

__all__ = ["NodeHook", "PipelineConfig", "PipelineNodes", "RolloutPipeline", "Stage", "build_nodes"]


def _global_step(data: DataProto | None) -> int | None:
    """ROLL's ``data.meta_info["global_step"]``, checked; None when not given."""
    if data is None or "global_step" not in data.meta_info:
        return None
    step = data.meta_info["global_step"]
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(
            f"get_batch: data.meta_info['global_step'] must be an int >= 0, got {step!r}"
        )
    return int(step)


_numbers = itertools.count(1)


def _engine_of(engine: Engine | Callable[[], Engine]) -> tuple[Engine, bool]:
    """``engine``, or what the zero-argument factory ``engine`` makes; True if made here."""
    if isinstance(engine, type) or (callable(engine) and not isinstance(engine, Engine)):
        made = engine()
        if not isinstance(made, Engine):
            raise TypeError(
                f"RolloutPipeline: the engine factory {engine!r} returned "
                f"{type(made).__name__}, not an Engine; give an engine or a zero-argument "
                "callable returning one, e.g. functools.partial(VLLMEngine, path)"
            )
        return made, True
    return engine, False


def _tokenizer_of(tokenizer: Any) -> Any:
    """``tokenizer``, or the one ``AutoTokenizer`` loads from the path ``tokenizer``."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    return tokenizer


class RolloutPipeline:
    """Iterate it for ``DataProto`` batches; drive it like ROLL's RolloutScheduler.

    ``engine`` is an engine, which belongs to the caller unless ``owns_engine=True``, or
    a zero-argument factory (``functools.partial(VLLMEngine, path)``) called here, whose
    engine the pipeline owns: the form to pass to a Ray actor, since an engine cannot be
    pickled (docs/ray-actor.md). ``tokenizer`` is a tokenizer or a path for
    ``AutoTokenizer.from_pretrained``. ``name`` names the pipeline in messages.
    ``env_factory`` replaces the env factory ``env_backend`` names (``build_nodes``): e.g.
    ``ray_env_factory(actor_options={"resources": {"envs": 0.01}})`` to place Ray env workers.

    Examples:
        >>> import torch; from rollpipe import ScriptedEngine
        >>> right = lambda: ScriptedEngine(lambda *_: tokenizer.encode("<answer>Right</answer>"))
        >>> with RolloutPipeline(PipelineConfig(group_size=2, batch_size=4), right, tokenizer) as p:
        ...     first = p.get_batch()
        ...     with p.suspended():  # ROLL's suspend, update the weights, resume
        ...         version = p.update_weights(torch.nn.Linear(2, 2))
        ...     second = p.get_batch()
        >>> len(first), version, second.batch["policy_versions"].max().item(), p.engine.closed
        (4, 1, 1, True)
    """

    def __init__(
        self,
        config: PipelineConfig,
        engine: Engine | Callable[[], Engine],
        tokenizer: Any,
        *,
        hooks: Mapping[Stage, NodeHook] | None = None,
        owns_engine: bool = False,
        name: str | None = None,
        env_factory: EnvForSpec | None = None,
    ) -> None:
        self.config = config
        self.name = name if name is not None else f"RolloutPipeline-{next(_numbers)}"
        self.tokenizer = _tokenizer_of(tokenizer)
        self.engine, made = _engine_of(engine)
        self.owns_engine = owns_engine or made
        try:
            self.nodes = build_nodes(
                config,
                self.engine,
                self.tokenizer,
                hooks=hooks,
                name=self.name,
                env_factory=env_factory,
            )
        except BaseException:
            if made:
                self.engine.close()
            raise
        self._loader = Loader(self.nodes.root, restart_on_stop_iteration=False)
        self._iter: Iterator[DataProto] | None = None
        self._batches_granted = 0  # get_batch calls that granted groups (metered source)
        self._step = -1  # the training step of the last grant (ROLL's global_step)
        self._expired_seen = 0  # source.expired() already reported in a batch
        self._exhausted = False  # the stream ended: the next get_batch(-1) starts afresh
        self._closed = False
        self._fetching = threading.Lock()  # one get_batch (or next) at a time

    # -- data -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosedError(f"{self.name} is closed; build a new one")

    def _iterator(self) -> Iterator[DataProto]:
        self._check_open()
        if self._iter is None:
            self._iter = iter(self._loader)
        return self._iter

    def __iter__(self) -> Iterator[DataProto]:
        return self

    def __next__(self) -> DataProto:
        """The next batch of ``config.batch_size``: ``get_batch()``, but the end of a
        finite stream raises ``StopIteration``."""
        self._check_open()
        self.suspension.check_holder()
        with self._fetching:
            self.suspension.enter_batch()
            stream = self._iterator()  # (re)started before the grant, which it must not lose
            self._grant(self.config.batch_size, self._step + 1)
            self.nodes.batch.request(self.config.batch_size)
            return self._with_expired(next(stream))

    def _grant(self, size: int, step: int) -> None:
        """Let the source start the groups of training ``step``: one batch of ``size``
        trajectories, or ``config.max_traj_per_env``'s worth if more (and, at the first
        batch, ``async_generation_ratio`` steps ahead)."""
        if step < self._step:
            raise ValueError(
                f"get_batch: global_step={step} is behind the previous step {self._step}; "
                "steps must not go back (build a new pipeline to start over)"
            )
        self._step = step
        ratio = self.config.async_generation_ratio
        if ratio is None:
            return
        per_step = self.config.groups_per_step
        if size == -1:
            groups = self.config.source.num_groups or 0
        elif self.config.max_traj_per_env is None:
            groups = size // self.config.source.group_size
        else:
            groups = max(size // self.config.source.group_size, per_step)
        if self._batches_granted == 0:
            groups += ratio * per_step
        self._batches_granted += 1
        self.nodes.signals.grant_groups(groups, step)

    def _with_expired(self, batch: DataProto) -> DataProto:
        """Report the granted groups that expired unstarted since the last batch."""
        expired = self.nodes.source.expired()
        batch.meta_info.setdefault("metrics", {})["dropped/expired"] = float(
            expired - self._expired_seen
        )
        self._expired_seen = expired
        return batch

    def _fresh_pass(self) -> None:
        """Start the stream again from its first episode (a new validation pass)."""
        self.nodes.signals.load_state(None)
        self._batches_granted = 0
        self._step, self._expired_seen = -1, 0
        self._iter = None
        self._exhausted = False

    def get_batch(
        self, data: DataProto | int | None = None, batch_size: int | None = None
    ) -> DataProto | None:
        """A batch of ``batch_size`` trajectories (default: the config's), blocking until
        filled; ``-1`` drains a finite source into one batch; None when nothing is left.

        Called as ROLL's ``get_batch(data, batch_size)`` (``data`` a DataProto whose
        ``meta_info["global_step"]`` is copied into the batch's meta_info) or as
        ``get_batch(batch_size)``. Like ROLL's, it resumes a ``suspend()``-ed pipeline,
        from whatever thread it is called (a Ray actor's calls run on several), and an
        engine paused by another pipeline sharing it. A held suspension
        (``suspend(hold=True)``, ``with suspended():``) holds it until ``resume()``: it
        waits (logging why after a few seconds), raises at once on the holding thread,
        and raises ``RuntimeClosedError`` if the pipeline is closed meanwhile. Calls from
        several threads take turns. Each ``get_batch(-1)`` after a finished one starts a
        fresh, identical pass over the same episodes (validation).

        Examples:
            >>> config = PipelineConfig(group_size=2, num_groups=2, max_turns=1)
            >>> with RolloutPipeline(config, engine, tokenizer) as pipe:
            ...     batch = pipe.get_batch(DataProto(meta_info={"global_step": 0}), 4)
            ...     len(batch), batch.meta_info["global_step"], pipe.get_batch(4)
            (4, 0, None)
        """
        if isinstance(data, int) and not isinstance(data, bool):
            data, batch_size = None, data
        if data is not None and not isinstance(data, DataProto):
            raise TypeError(
                f"get_batch: data must be a DataProto (with meta_info['global_step']) or "
                f"None, got {type(data).__name__}; pass the batch size as batch_size="
            )
        size = self.config.batch_size if batch_size is None else batch_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"get_batch: batch_size must be an int, got {size!r}")
        if size != -1 and (size < 1 or size % self.config.source.group_size):
            raise ValueError(
                f"get_batch: batch_size={size} must be -1 or a positive multiple of "
                f"group_size={self.config.source.group_size}"
            )
        if size == -1 and self.config.source.num_groups is None:
            raise ValueError("get_batch(-1) drains a finite source; set num_groups in the config")
        step = _global_step(data)
        self._check_open()
        self.suspension.check_holder()  # before taking turns: it would wait for itself
        with self._fetching:
            return self._fetch(size, step)

    def _fetch(self, size: int, step: int | None) -> DataProto | None:
        if size == -1 and self._exhausted:
            self._fresh_pass()
        self.suspension.enter_batch()  # resumes a suspend(); waits out a held one
        if not self.suspension.is_suspended and self.engine.is_paused:
            self.engine.resume()  # paused by another pipeline sharing the engine
        stream = self._iterator()  # (re)started before the grant, which it must not lose
        self._grant(size, self._step + 1 if step is None else step)
        self.nodes.batch.request(size)
        try:
            batch = next(stream)
        except StopIteration:
            self._exhausted = True
            return None
        if size == -1:
            self._exhausted = True
        if step is not None:
            batch.meta_info["global_step"] = step
        return self._with_expired(batch)

    # -- weights ----------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The engine's current policy version.

        Examples:
            >>> with RolloutPipeline(PipelineConfig(), engine, tokenizer) as pipe:
            ...     pipe.version == engine.version
            True
        """
        return self.engine.version

    @property
    def suspension(self) -> Suspension:
        """The pipeline's one ``Suspension``: ``state``, ``mode``, ``held``, ``asked_by``.

        Examples:
            >>> with RolloutPipeline(PipelineConfig(), engine, tokenizer) as pipe:
            ...     pipe.suspension.state, pipe.suspension.held
            ('running', False)
        """
        return self.nodes.suspension

    def suspend(self, mode: PauseMode = DEFAULT_MODE, *, hold: bool = False) -> None:
        """Close admission and pause the engine until the next ``get_batch`` (from any
        thread) or ``resume()``; with ``hold=True`` only ``resume()`` ends it.

        ``abort`` (default, as ROLL's suspend: abort all, then wait) ends in-flight
        requests, whose turns are regenerated after resuming; ``keep`` freezes them;
        ``wait`` lets them finish. Already suspended: the same mode is a no-op, another
        raises ``ValueError`` (resume first). Closed: raises ``RuntimeClosedError``.

        Examples:
            >>> with RolloutPipeline(PipelineConfig(), engine, tokenizer) as pipe:
            ...     pipe.suspend("keep"); print(engine.is_paused); pipe.resume()
            True
        """
        self.suspension.suspend(mode, hold=hold)

    def resume(self) -> None:
        """End the suspension (held or not); a no-op when running. Closed: raises
        ``RuntimeClosedError``.

        Examples:
            >>> with RolloutPipeline(PipelineConfig(), engine, tokenizer) as pipe:
            ...     pipe.suspend(hold=True); pipe.resume(); print(engine.is_paused)
            False
        """
        self.suspension.resume()

    def suspended(self, mode: PauseMode = DEFAULT_MODE) -> Any:
        """Context manager: a held suspension for the block (resumed on exit).

        Examples:
            >>> with RolloutPipeline(PipelineConfig(), engine, tokenizer) as pipe:
            ...     with pipe.suspended("wait"): print(pipe.suspension.held, engine.is_paused)
            True True
        """
        return self.suspension.suspended(mode)

    def update_weights(self, weights: WeightsLike, version: int | None = None) -> int:
        """Load ``weights`` into the engine; returns the new version. Closed: raises
        ``RuntimeClosedError`` and leaves the engine alone.

        Examples:
            >>> import torch; from rollpipe import ScriptedEngine
            >>> with RolloutPipeline(PipelineConfig(), lambda: ScriptedEngine(lambda *_: []),
            ...                      tokenizer) as pipe, pipe.suspended():
            ...     pipe.update_weights({"w": torch.ones(1)}, version=3), pipe.version
            (3, 3)
        """
        return self.suspension.update_weights(weights, version=version)

    # -- engines (an EnginePool) ------------------------------------------------------
    def shrink_sampler(self, target_gpus: Iterable[int]) -> dict[str, Any]:
        """ROLL's name: take the pool's ranks on ``target_gpus`` out of generation (their
        requests are re-sent to the ranks that stay); see ``EnginePool.shrink``. Callable
        while ``get_batch`` blocks in another thread.

        Examples:
            >>> from rollpipe import ScriptedEngine
            >>> pool = lambda: EnginePool(lambda rank: ScriptedEngine(lambda *_: []), 2)
            >>> with RolloutPipeline(PipelineConfig(), pool, tokenizer) as pipe:
            ...     pipe.shrink_sampler([1])["offload_ranks"], pipe.engine.active_ranks
            ([1], [0])
        """
        return self._pool("shrink_sampler").shrink(target_gpus)

    def expand_sampler(self, target_gpus: Iterable[int], skip_load: bool = False) -> dict[str, Any]:
        """ROLL's name: bring the pool's ranks within ``target_gpus`` back, with the current
        weights (``skip_load``: checked to be current already); see ``EnginePool.expand``.

        Examples:
            >>> from rollpipe import ScriptedEngine
            >>> pool = lambda: EnginePool(lambda rank: ScriptedEngine(lambda *_: []), 2)
            >>> with RolloutPipeline(PipelineConfig(), pool, tokenizer) as pipe:
            ...     _ = pipe.shrink_sampler([1]); pipe.expand_sampler([1])["load_ranks"]
            [1]
        """
        return self._pool("expand_sampler").expand(target_gpus, skip_load=skip_load)

    def _pool(self, what: str) -> EnginePool:
        if not isinstance(self.engine, EnginePool):
            raise TypeError(
                f"{what} needs the pipeline's engine to be an EnginePool (many engines on "
                f"devices), got {type(self.engine).__name__}; build it with EnginePool(...)"
            )
        return self.engine

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands, as plain data (ints, strings, lists, dicts, tensors):
        ``torch.save`` it and ``torch.load(..., weights_only=True)`` it back. A fresh
        pipeline loading it yields exactly what this one would have.

        Examples:
            >>> with RolloutPipeline(PipelineConfig(), engine, tokenizer) as pipe:
            ...     sorted(pipe.state_dict())
            ['batches_granted', 'expired_seen', 'loader', 'signals', 'step']
        """
        self._iterator()
        return {
            "loader": self._loader.state_dict(),
            "signals": self.nodes.signals.get_state(),
            "batches_granted": self._batches_granted,
            "step": self._step,
            "expired_seen": self._expired_seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a ``state_dict()``, on a fresh pipeline of the same config.

        Examples:
            >>> config = PipelineConfig(group_size=2, batch_size=2, num_groups=2, max_turns=1)
            >>> with RolloutPipeline(config, engine, tokenizer) as pipe:
            ...     _, state = pipe.get_batch(), pipe.state_dict()
            >>> with RolloutPipeline(config, engine, tokenizer) as fresh:
            ...     fresh.load_state_dict(state); fresh.get_batch().batch["traj_id"].tolist()
            [2, 3]
        """
        self.nodes.signals.load_state(state["signals"])
        self._batches_granted = int(state["batches_granted"])
        self._step, self._expired_seen = int(state["step"]), int(state["expired_seen"])
        self._loader.load_state_dict(state["loader"])
        self._iter = iter(self._loader)

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Stop the episodes and threads this pipeline started (and the engine if owned).

        Idempotent and prompt from any state: a thread blocked in ``get_batch()`` (waiting
        for trajectories, or for ``resume()``) wakes at once with ``RuntimeClosedError``;
        a suspended pipeline is resumed (an engine that can no longer resume is ignored);
        an env call in flight is abandoned, not awaited (its thread ends when it returns).

        Examples:
            >>> pipe = RolloutPipeline(PipelineConfig(), engine, tokenizer)
            >>> pipe.close(); pipe.close(); pipe.suspension.closed, engine.closed  # not its engine
            (True, False)
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.suspension.close(f"close() from thread {threading.current_thread().name!r}")
            close_chain(self.nodes.root)
        finally:
            if self.owns_engine:
                self.engine.close()

    def shutdown(self) -> None:
        """ROLL's name for ``close()``.

        Examples:
            >>> pipe = RolloutPipeline(PipelineConfig(), engine, tokenizer)
            >>> pipe.shutdown(); pipe.suspension.state
            'closed'
        """
        self.close()

    def __enter__(self) -> RolloutPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
