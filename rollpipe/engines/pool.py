"""EnginePool: many engines behind one ``Engine``, with ROLL's shrink / expand.

Each rank is one engine on a set of devices (plain CPU engines get logical ids ``[i]``).
The pool is an ``Engine`` itself, so every stage and the pipeline use it unchanged:

* **Routing.** Each request goes to the rank its router picks among the active ones
  (``routing.py``): by default an episode sticks to its rank across turns (its prefix
  stays in that rank's KV cache) and a new one goes to the rank with the fewest
  in-flight requests. ``routing_log`` records ``(session key, rank)`` per request.
* **Control.** ``pause`` / ``resume`` / ``update_weights`` fan out to the active ranks;
  ``version`` is one number for the pool, and each token keeps the exact version of the
  rank that generated it.
* **Shrink / expand** (ROLL's ``shrink_sampler`` / ``expand_sampler``): ``shrink``
  takes out every rank touching the given devices — its in-flight requests are aborted
  and re-sent to the ranks that stay (the turn is regenerated; the episode goes on),
  its sessions' routes are cleared, and its engine is freed. ``expand`` rebuilds every
  rank within the given devices with ``make_engine(rank)`` and loads the pool's current
  weights (a CPU copy kept from the last ``update_weights``) unless ``skip_load``, in
  which case a rank not at the pool's version is refused. vLLM's sleep mode is not
  available on its CPU backend, so offloading frees the engine and expanding rebuilds it.

Requests run on the pool's own runtime (where a ``EpisodeRunner`` runs its episodes) and reach
each rank's engine through that engine's runtime. Control calls (``pool_control.py``)
block their caller and run one at a time, under the pool's lock; they may come from any
thread while requests are in flight. The pool's version, pause mode, interruptions and
closing are an ``EngineState`` (``state.py``), the same rules as each ``BaseEngine``'s.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Self

import torch

from rollpipe._utils.checks import check_int
from rollpipe.engines.inputs import PromptIds, check_prompt
from rollpipe.engines.pool_control import PoolControl
from rollpipe.engines.pool_ranks import Rank, RankTable, pool_devices
from rollpipe.engines.protocol import Engine, OnTokens, engine_supports
from rollpipe.engines.records import EngineClosedError, EngineError, Generation, SamplingParams
from rollpipe.engines.routing import RankLoad, Route, Router, current_route, make_router
from rollpipe.engines.state import EngineState, EngineStateView
from rollpipe.runtime import Runtime

__all__ = ["EnginePool"]


def _counted(on_tokens: Callable[[list[int]], None], count: list[int]) -> OnTokens:
    """``on_tokens``, counting the ids it passed on in ``count[0]``."""

    def counted(ids: list[int]) -> None:
        count[0] += len(ids)
        on_tokens(ids)

    return counted


class EnginePool(PoolControl, EngineStateView):
    """``num_engines`` engines made by ``make_engine(rank)``, behind one ``Engine``.

    ``devices[i]`` lists rank ``i``'s device ids (default ``[i]``); ``router`` is a name
    from ``rollpipe.engines.routing.ROUTERS`` or an object with ``route(session, loads)``.

    Examples:
        >>> from rollpipe.engines.scripted import ScriptedEngine
        >>> def make_engine(rank):  # rank i's engine answers [i, i, i]
        ...     return ScriptedEngine(lambda prompt_ids, params: [rank] * 3)
        >>> with EnginePool(make_engine, 2) as pool:
        ...     gens = pool.generate_batch([[1], [2, 3]], SamplingParams(max_tokens=2))
        ...     pool.num_engines, [g.num_tokens for g in gens], gens[0].finish_reason
        (2, [2, 2], 'length')
    """

    def __init__(
        self,
        make_engine: Callable[[int], Engine],
        num_engines: int = 2,
        *,
        devices: Sequence[Iterable[int]] | None = None,
        router: str | Router = "least_requests",
        routing_log_size: int = 100_000,
    ) -> None:
        check_int("EnginePool: num_engines", num_engines, 1)
        check_int("EnginePool: routing_log_size", routing_log_size, 0)
        device_sets = pool_devices(devices, num_engines)
        chosen_router = make_router(router)
        self._make_engine = make_engine
        engines: list[Engine] = []
        try:
            for i in range(num_engines):
                engines.append(self._build(i))
            versions = [e.version for e in engines]
            if len(set(versions)) > 1:
                raise ValueError(f"EnginePool: engines start at different versions {versions}")
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        ranks = [Rank(i, device_sets[i], e) for i, e in enumerate(engines)]
        self._state = EngineState("EnginePool", version=versions[0], noun="pool")
        self._table = RankTable(ranks, chosen_router, routing_log_size, self._state)
        self._all_devices = frozenset().union(*device_sets)
        self._weights: list[tuple[str, torch.Tensor]] | None = None  # CPU copy, for expand
        self._control = threading.Lock()  # one pause / resume / update / shrink / expand
        self._runtime = Runtime("rollpipe-engine-pool")
        self._scope = self._runtime.scope("engine-pool")

    @classmethod
    def vllm(cls, model_path: Any, num_engines: int = 2, **kwargs: Any) -> EnginePool:
        """A pool of ``VLLMEngine(model_path, **engine_kwargs)``; pool options
        (``devices``, ``router``, ``routing_log_size``) are taken out of ``kwargs``.

        Examples:
            >>> # pool = EnginePool.vllm(model_path, 2, kv_cache_space_gib=1, router="random")
            >>> EnginePool.vllm("/no/model/here", 2)  # each rank's VLLMEngine checks its path
            Traceback (most recent call last):
            ...
            ValueError: VLLMEngine: model_path '/no/model/here' has no config.json; ...
        """
        from rollpipe.engines.vllm import VLLMEngine

        pool_keys = ("devices", "router", "routing_log_size")
        options = {k: kwargs.pop(k) for k in pool_keys if k in kwargs}
        return cls(lambda rank: VLLMEngine(model_path, **kwargs), num_engines, **options)

    def _build(self, index: int) -> Engine:
        engine = self._make_engine(index)
        if not isinstance(engine, Engine):
            raise TypeError(f"EnginePool: make_engine({index}) returned {engine!r}, not an Engine")
        return engine

    # -- state (version, pause_mode, closed, ...: EngineStateView) ----------------------
    @property
    def runtime(self) -> Runtime:
        """The pool's event loop: episodes run here and reach each rank's engine from it.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     gen = pool.runtime.call(pool.generate([1, 2], SamplingParams()))
            ...     gen.token_ids, pool.runtime.alive
            ((7,), True)
        """
        return self._runtime

    @property
    def num_engines(self) -> int:
        """Ranks in the pool, active or not (see ``active_ranks``).

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     _ = pool.shrink([1])
            ...     pool.num_engines, pool.active_ranks
            (2, [0])
        """
        return len(self._table.ranks)

    @property
    def active_ranks(self) -> list[int]:
        """The ranks requests are routed to (not shrunk, not failed), in order.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 3) as pool:
            ...     _ = pool.shrink([0])
            ...     pool.active_ranks
            [1, 2]
        """
        return [load.rank for load in self._table.loads()]

    @property
    def routing_log(self) -> deque[tuple[Hashable | None, int]]:
        """``(session key, rank)`` of each routed request, the latest ``routing_log_size``.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     _ = pool.generate_batch([[1, 2]], SamplingParams())
            ...     list(pool.routing_log)  # no session: not made by an episode
            [(None, 0)]
        """
        return self._table.routing_log

    @property
    def rerouted(self) -> int:
        """Requests re-sent because their rank left the pool (shrunk or failed).

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     pool.engine(0).close()  # rank 0's engine dies
            ...     gen = pool.generate_batch([[1, 2]], SamplingParams())[0]  # routed to rank 0
            ...     gen.token_ids, pool.rerouted
            ((7,), 1)
        """
        return self._table.rerouted

    def loads(self) -> list[RankLoad]:
        """Each active rank's in-flight requests and tokens, now.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     pool.loads()
            [RankLoad(rank=0, requests=0, tokens=0), RankLoad(rank=1, requests=0, tokens=0)]
        """
        return self._table.loads()

    def rank_devices(self, rank: int) -> frozenset[int]:
        """Rank ``rank``'s device ids (``devices[rank]``, default ``{rank}``).

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> make = lambda rank: ScriptedEngine(lambda p, s: [7])
            >>> with EnginePool(make, 2, devices=[[0, 1], [2, 3]]) as pool:
            ...     sorted(pool.rank_devices(1))
            [2, 3]
        """
        return self._table.ranks[rank].devices

    def engine(self, rank: int) -> Engine | None:
        """Rank ``rank``'s engine (None while it is offloaded).

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     _ = pool.shrink([1])
            ...     type(pool.engine(0)).__name__, pool.engine(1)
            ('ScriptedEngine', None)
        """
        return self._table.ranks[rank].engine

    def failures(self) -> dict[int, BaseException]:
        """Ranks taken out because their engine failed, with the error.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     pool.engine(0).close()  # rank 0's engine dies; its request goes to rank 1
            ...     gen = pool.generate_batch([[1, 2]], SamplingParams())[0]
            ...     pool.failures(), pool.active_ranks
            ({0: EngineError('rank 0 (devices [0]): its engine died')}, [1])
        """
        return {r.index: r.error for r in self._table.ranks if r.error is not None}

    def supports(self, feature: str) -> bool:
        """Whether every active rank's engine honours ``feature`` (``BaseEngine.supports``).

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     pool.supports("top_logprobs"), pool.supports("on_tokens")
            (False, False)
        """
        engines = self._table.active_engines()
        return bool(engines) and all(engine_supports(e, feature) for e in engines)

    # -- requests --------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: PromptIds,
        params: SamplingParams,
        *,
        on_tokens: OnTokens = None,
        images: Sequence[Any] = (),
    ) -> Generation:
        """Route one request; re-send it if its rank leaves the pool before it finishes.

        ``images`` go with the request to the rank's engine (``BaseEngine.generate``;
        where ``supports("images")``, else that engine raises ``EngineError``).
        ``on_tokens`` reaches the rank's engine; it is called on that engine's loop. A
        streamed request (``on_tokens``) is not re-sent from its start, since its first
        ids are already out: it continues on another rank from the prompt plus those ids,
        with the budget left; if its rank's engine fails after streaming, it fails.

        Examples:
            >>> import asyncio
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7, 8, 9]), 2) as pool:
            ...     gen = asyncio.run(pool.generate([1, 2], SamplingParams(max_tokens=2)))
            ...     gen.token_ids, gen.finish_reason, gen.versions
            ((7, 8), 'length', (0, 0))
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     asyncio.run(pool.generate([1, 2], SamplingParams(), images=[object()]))
            Traceback (most recent call last):
            ...
            rollpipe.engines.records.EngineError: ScriptedEngine.generate(images=...): ...
        """
        prompt = check_prompt(prompt_ids)  # each rank checks the ids against its vocabulary
        self._state.check_open()
        session = current_route()  # read in the caller's task, before any hop
        pictures = tuple(images) if images else None
        return await self._scope.run(self._generate(prompt, params, session, on_tokens, pictures))

    def generate_batch(
        self, prompts: Sequence[PromptIds], params: SamplingParams
    ) -> list[Generation]:
        """Synchronous convenience: all ``prompts`` submitted at once, results in order.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2) as pool:
            ...     gens = pool.generate_batch([[1], [2, 3], [4]], SamplingParams())
            ...     [g.token_ids for g in gens], len(pool.routing_log)
            ([(7,), (7,), (7,)], 3)
        """
        if self._runtime.in_loop():
            raise EngineError("generate_batch blocks; do not call it on the pool's own loop")
        checked = [check_prompt(p) for p in prompts]
        self._state.check_open()
        futures = [self._scope.submit(self._generate(p, params, None)) for p in checked]
        return [f.result() for f in futures]

    async def _generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        session: Route | None,
        on_tokens: OnTokens = None,
        images: tuple[Any, ...] | None = None,
    ) -> Generation:
        cost = len(prompt) + params.max_tokens
        parts: list[Generation] = []  # a streamed request's tokens from ranks that left
        while True:
            rank, engine = self._table.pick(session, cost)
            streamed = [0]
            try:
                # engines written before on_tokens or images keep working: only what is used
                kwargs: dict[str, Any] = {} if images is None else {"images": images}
                if on_tokens is not None:
                    kwargs["on_tokens"] = _counted(on_tokens, streamed)
                gen = await engine.generate(prompt, params, **kwargs)
                # aborted because its rank left mid-request: regenerate the turn elsewhere
                resend = gen.finish_reason == "abort" and self._table.resent_if_left(rank, engine)
            except EngineError:
                if not self._table.left_or_failed(rank, engine) or streamed[0]:
                    raise  # (tokens already streamed cannot be taken back: fail the request)
                resend = True
            finally:
                self._table.release(rank, cost)
            if not resend:
                return Generation.joined([*parts, gen], gen.finish_reason) if parts else gen
            if on_tokens is not None and gen.token_ids:  # continue from what was streamed
                parts.append(gen)
                left = params.max_tokens - len(gen.token_ids)
                if left < 1:
                    return Generation.joined(parts, "length")
                prompt, params = [*prompt, *gen.token_ids], params.replace(max_tokens=left)

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Close every rank's engine and the pool's runtime; waiting callers get
        EngineClosedError at once.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> pool = EnginePool(lambda rank: ScriptedEngine(lambda p, s: [7]), 2)
            >>> first = pool.engine(0)
            >>> pool.close()
            >>> pool.closed, first.closed
            (True, True)
        """
        if self._state.closed:
            return
        engines = self._table.close()  # closes the state under the table's lock
        error = EngineClosedError("EnginePool was closed")
        self._scope.close(error)
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.close()
        self._runtime.close(error)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
