"""BaseEngine: the ``Engine`` protocol on a runtime, driving one ``Backend``.

An engine runs on a ``Runtime`` (an event loop in its own thread): ``generate`` is a
coroutine on that loop, awaitable from any loop or thread, and the synchronous methods
(``generate_batch``, ``pause``, ``resume``, ``update_weights``) block their caller until
the loop has run them. ``BaseEngine`` is the one owner of the engine's state (policy
version, pause mode, death, closing); its backend (``backend.py``) only generates and
learns that state through an ``EngineLink``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Self, TypeVar

import torch

from rollpipe._utils.checks import check_int
from rollpipe.engines.backend import Backend, EngineLink
from rollpipe.engines.inputs import PromptIds, check_prompt, named_tensors
from rollpipe.engines.protocol import PAUSE_MODES, PauseMode, WeightsLike
from rollpipe.engines.records import EngineClosedError, EngineError, Generation, SamplingParams
from rollpipe.runtime import Runtime

__all__ = ["BaseEngine"]

T = TypeVar("T")


class BaseEngine:
    """The protocol's machinery, shared by every engine: runtime, state, close.

    A subclass builds its backend on the engine's loop with ``_attach`` (from its
    ``__init__``, after ``super().__init__``); the rest is here.
    """

    _backend: Backend

    def __init__(
        self, *, name: str, version: int = 0, loop_init: Callable[[], None] | None = None
    ) -> None:
        self._version = check_int(f"{type(self).__name__}: version", version, 0)
        self._pause_mode: PauseMode | None = None
        self._interruptions = 0  # pauses, resumes and weight updates so far
        self._closed = False
        self._dead: BaseException | None = None
        self._tokens_generated = 0
        self._control = asyncio.Lock()  # one pause / resume / weight update at a time
        self._link = EngineLink(
            version=lambda: self._version,
            pause_mode=lambda: self._pause_mode,
            on_death=self._on_death,
            produced=self._produced,
        )
        self._runtime = Runtime(name, loop_init)
        self._scope = self._runtime.scope(name)

    def _attach(
        self, start: Callable[[EngineLink], Coroutine[Any, Any, Backend]], what: str
    ) -> None:
        """Build the backend with ``start(link)`` on the engine's loop; close on failure."""
        try:
            self._backend = self._call(start(self._link))
        except BaseException as e:
            self._closed = True
            self._runtime.close()
            raise EngineError(f"{type(self).__name__} failed to start on {what}: {e!r}") from e
        self._backend_reports_tokens = bool(getattr(self._backend, "reports_tokens", False))

    # -- state ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def is_paused(self) -> bool:
        return self._pause_mode is not None

    @property
    def interruptions(self) -> int:
        """Pauses and weight updates so far (see ``Engine.interruptions``)."""
        return self._interruptions

    @property
    def tokens_generated(self) -> int:
        """Tokens this engine has generated so far, over all requests (throughput, or a
        test's "requests are running"). Read-only, from any thread.

        The in-process backends (transformers, vLLM) count tokens as they are produced, so
        the count grows while a request runs, aborted requests included; for a remote
        engine (Ray actor, vLLM server) it grows by each generation's tokens when that
        generation returns.

        After ``gens = engine.generate_batch(prompts, params)`` on an otherwise idle
        engine, the count has grown by ``sum(len(g.token_ids) for g in gens)``.
        """
        return self._tokens_generated

    def _produced(self, n: int) -> None:
        self._tokens_generated += n  # on the engine's loop only: no lock needed

    @property
    def pause_mode(self) -> PauseMode | None:
        """The mode of the current pause, None while running."""
        return self._pause_mode

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        """Whether the engine can still generate (neither closed nor dead)."""
        return not self._closed and self._dead is None

    @property
    def runtime(self) -> Runtime:
        """The event loop this engine runs on. Coroutines running on it (a ``Rollout``'s
        episodes) reach the engine without a thread hop."""
        return self._runtime

    def _on_death(self, error: BaseException) -> None:
        """The backend can no longer generate: later calls fail fast with EngineError."""
        if self._dead is None:
            self._dead = error

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(
                f"{type(self).__name__} is closed; create a new engine to generate again"
            )
        if self._dead is not None:
            raise EngineError(
                f"{type(self).__name__} died ({self._dead!r}); create a new engine"
            ) from self._dead

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the engine's runtime and block for its result (not from its loop)."""
        if self._runtime.in_loop():
            coro.close()
            raise EngineError(
                "this synchronous engine method was called from the engine's own event loop; "
                "call it from another thread"
            )
        try:
            self._check_open()
        except EngineError:
            coro.close()
            raise
        return self._scope.call(coro, timeout)

    # -- the protocol --------------------------------------------------------------------
    async def generate(self, prompt_ids: PromptIds, params: SamplingParams) -> Generation:
        """Generate one completion; awaitable from any event loop or thread."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = check_prompt(prompt_ids, self._backend.vocab_size)
        self._check_open()
        return await self._scope.run(self._generate(prompt, params))

    def generate_batch(
        self, prompts: Sequence[PromptIds], params: SamplingParams
    ) -> list[Generation]:
        """Synchronous convenience: all ``prompts`` submitted at once, results in order."""
        if self._runtime.in_loop():
            raise EngineError("generate_batch blocks; do not call it on the engine's own loop")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        checked = [check_prompt(p, self._backend.vocab_size) for p in prompts]
        self._check_open()
        futures = [self._scope.submit(self._generate(p, params)) for p in checked]
        return [f.result() for f in futures]

    def pause(self, mode: PauseMode = "keep") -> None:
        """Stop generating: ``keep`` freezes in-flight requests, ``abort`` ends them with
        finish_reason "abort", ``wait`` lets them finish. New requests wait for resume."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._call(self._pause(mode))

    def resume(self) -> None:
        """Undo ``pause``: frozen and queued requests continue."""
        self._call(self._resume())

    def update_weights(self, weights: WeightsLike, version: int | None = None) -> int:
        """Load ``weights`` into the live engine; returns and stores the new version.

        ``version`` defaults to the current version + 1. Tokens produced after the call
        carry the new version.
        """
        if version is not None:
            check_int("update_weights: version", version, 0)
        named = named_tensors(weights)
        self._call(self._load_weights(named, version))
        return self._version

    def close(self) -> None:
        """Stop the engine; waiting and later ``generate`` calls raise EngineClosedError.

        Every waiting caller is failed at once; the backend then stops, waiting for at
        most the step in flight.
        """
        if self._closed:
            return
        self._closed = True
        error = EngineClosedError(f"{type(self).__name__} was closed")
        self._scope.close(error)  # wakes every caller waiting on a request, at once
        backend: Backend | None = getattr(self, "_backend", None)  # None: it never started
        try:
            if backend is not None and self._runtime.alive:
                self._runtime.call(backend.shutdown(error), timeout=60)
        except Exception:  # best effort: the runtime is closed below either way
            pass
        finally:
            self._runtime.close(error)
            if backend is not None:
                backend.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- on the loop ---------------------------------------------------------------------
    async def _generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        gen = await self._backend.generate(prompt, params)
        if not self._backend_reports_tokens:  # counted as produced otherwise
            self._produced(len(gen.token_ids))
        return gen

    async def _pause(self, mode: PauseMode) -> None:
        async with self._control:
            previous, self._pause_mode = self._pause_mode, mode
            self._interruptions += 1
            try:
                await self._backend.pause(mode)
            except BaseException:
                self._pause_mode = previous
                raise

    async def _resume(self) -> None:
        async with self._control:
            self._pause_mode = None
            self._interruptions += 1
            await self._backend.resume()

    async def _load_weights(
        self, named: list[tuple[str, torch.Tensor]], version: int | None
    ) -> None:
        async with self._control:
            new_version = self._version + 1 if version is None else version
            self._interruptions += 1
            await self._backend.load_weights(named, new_version)
            self._version = new_version  # no await since the load: see Backend.load_weights
