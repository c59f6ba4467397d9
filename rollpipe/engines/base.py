"""BaseEngine: the ``Engine`` protocol on a runtime, driving one ``Backend``.

An engine runs on a ``Runtime`` (an event loop in its own thread): ``generate`` is a
coroutine on that loop, awaitable from any loop or thread, and the synchronous methods
(``generate_batch``, ``pause``, ``resume``, ``update_weights``) block their caller until
the loop has run them. ``BaseEngine`` is the one owner of the engine's state (policy
version, pause mode, death, closing); its backend (``backend.py``) only generates and
learns that state through an ``EngineLink``. The state and its rules are an
``EngineState`` (``state.py``, shared with ``EnginePool``); ``BaseEngine`` runs its
transitions on the loop, one at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Self, TypeVar, cast

import torch

from rollpipe.engines.backend import Backend, EngineLink
from rollpipe.engines.images import (
    ImageLike,
    VisionTokens,
    check_generation,
    check_image_prompt,
    check_images,
    refuse_images,
)
from rollpipe.engines.inputs import (
    PromptIds,
    PromptView,
    check_prompt,
    check_prompt_view,
    named_tensors,
)
from rollpipe.engines.protocol import OnTokens, PauseMode, WeightsLike
from rollpipe.engines.records import EngineClosedError, EngineError, Generation, SamplingParams
from rollpipe.engines.state import (
    EngineState,
    EngineStateView,
    check_new_version,
    check_pause_mode,
)
from rollpipe.runtime import Runtime

__all__ = ["BaseEngine"]

T = TypeVar("T")


class BaseEngine(EngineStateView):
    """The protocol's machinery, shared by every engine: runtime, state, close.

    A subclass builds its backend on the engine's loop with ``_attach`` (from its
    ``__init__``, after ``super().__init__``); the rest is here.
    """

    _backend: Backend

    def __init__(
        self, *, name: str, version: int = 0, loop_init: Callable[[], None] | None = None
    ) -> None:
        self._state = EngineState(type(self).__name__, version=version)
        self._tokens_generated = 0
        self._control = asyncio.Lock()  # one pause / resume / weight update at a time
        state = self._state
        self._link = EngineLink(
            version=lambda: state.version,
            pause_mode=lambda: state.pause_mode,
            on_death=state.mark_dead,
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
            self._state.close()
            self._runtime.close()
            raise EngineError(f"{type(self).__name__} failed to start on {what}: {e!r}") from e
        self._backend_reports_tokens = bool(getattr(self._backend, "reports_tokens", False))
        # a backend that reads prompts as sequences gets an episode's PromptView as it is
        views = bool(getattr(self._backend, "takes_views", False))
        self._check_prompt = check_prompt_view if views else check_prompt
        # beyond the basics: top_logprobs, structured_outputs, on_tokens, images
        self._features = frozenset(getattr(self._backend, "features", ()))
        # a vision-language model's special tokens: every request and response is checked
        self._vision: VisionTokens | None = getattr(self._backend, "vision", None)

    # -- state (version, pause_mode, closed, ...: EngineStateView) ----------------------
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

        Examples:
            >>> before = engine.tokens_generated
            >>> params = SamplingParams(max_tokens=5, ignore_eos=True)
            >>> gens = engine.generate_batch([[1, 2, 3], [4, 5]], params)
            >>> engine.tokens_generated - before
            10
        """
        return self._tokens_generated

    def _produced(self, n: int) -> None:
        self._tokens_generated += n  # on the engine's loop only: no lock needed

    @property
    def runtime(self) -> Runtime:
        """The event loop this engine runs on. Coroutines running on it (a ``EpisodeRunner``'s
        episodes) reach the engine without a thread hop.

        Examples:
            >>> async def two_turns() -> int:  # both calls on the engine's own loop
            ...     params = SamplingParams(max_tokens=2, ignore_eos=True)
            ...     first = await engine.generate([1, 2], params)
            ...     return (await engine.generate([1, 2, *first.token_ids], params)).num_tokens
            >>> engine.runtime.call(two_turns()), engine.runtime.alive
            (2, True)
        """
        return self._runtime

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the engine's runtime and block for its result (not from its loop)."""
        if self._runtime.in_loop():
            coro.close()
            raise EngineError(
                "this synchronous engine method was called from the engine's own event loop; "
                "call it from another thread"
            )
        try:
            self._state.check_open()
        except EngineError:
            coro.close()
            raise
        return self._scope.call(coro, timeout)

    # -- the protocol --------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: PromptIds,
        params: SamplingParams,
        *,
        on_tokens: OnTokens = None,
        images: Sequence[ImageLike] = (),
    ) -> Generation:
        """Generate one completion; awaitable from any event loop or thread.

        ``on_tokens`` gets the response's ids as they are produced (``OnTokens``).
        ``images`` (where ``supports("images")``): all of the conversation's images so far,
        in order (PIL or HxWx3 uint8), one image pad id each in ``prompt_ids``; the
        expanded prompt comes back as ``prompt_token_ids`` (``rollpipe.engines.images``).

        Examples:
            >>> params, streamed = SamplingParams(max_tokens=4, ignore_eos=True), []
            >>> gen = asyncio.run(engine.generate([1, 2, 3], params, on_tokens=streamed.extend))
            >>> gen.num_tokens, gen.finish_reason, streamed == list(gen.token_ids)
            (4, 'length', True)
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.top_logprobs or params.structured_outputs is not None:
            self._check_features(params)
        prompt = self._check_prompt(prompt_ids, self._backend.vocab_size)
        if images or self._vision is not None:
            return await self._generate_images(prompt, params, on_tokens, images)
        self._state.check_open()
        if self._runtime.in_loop():  # an EpisodeRunner's episode: no hop, no task (Scope.run)
            self._scope.check_open()
            return await self._generate(prompt, params, on_tokens)
        return await self._scope.run(self._generate(prompt, params, on_tokens))

    async def _generate_images(
        self, prompt: Any, params: SamplingParams, on_tokens: OnTokens, images: Any
    ) -> Generation:
        """A request to a vision-language model (or with images), checked going and back."""
        where = f"{type(self).__name__} request"
        if self._vision is None:
            raise refuse_images(type(self).__name__, self._backend)
        pictures = check_images(images)
        check_image_prompt(prompt, len(pictures), self._vision, where)
        self._state.check_open()
        if in_loop := self._runtime.in_loop():  # no hop, no task, as in generate
            self._scope.check_open()
        work = self._generate(prompt, params, on_tokens, pictures)
        gen = await (work if in_loop else self._scope.run(work))
        check_generation(prompt, gen, self._vision, where, bool(pictures))
        return gen

    def supports(self, feature: str) -> bool:
        """Whether this engine honours ``feature``: ``"top_logprobs"``, ``"structured_outputs"``
        (``SamplingParams`` fields), ``"on_tokens"`` (ids as they are produced, not all
        at once at the end) or ``"images"`` (``generate(..., images=...)``: a VLLMEngine
        or HFEngine on a vision-language model).

        Examples:
            >>> engine.supports("top_logprobs"), engine.supports("structured_outputs")
            (True, True)
            >>> engine.supports("images")  # the tiny model reads text only
            False
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     scripted.supports("top_logprobs")
            False
        """
        return feature in self._features

    def _check_features(self, params: SamplingParams) -> None:
        for field in ("top_logprobs", "structured_outputs"):
            if getattr(params, field) not in (0, None) and field not in self._features:
                raise EngineError(
                    f"SamplingParams.{field}={getattr(params, field)!r}: {type(self).__name__} "
                    f"does not support {field}; leave it at its default or use a vLLM engine"
                )

    def generate_batch(
        self, prompts: Sequence[PromptIds], params: SamplingParams
    ) -> list[Generation]:
        """Synchronous convenience: all ``prompts`` submitted at once, results in order.

        Examples:
            >>> greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            >>> a, b = engine.generate_batch([tokenizer.encode("Hello")] * 2, greedy)
            >>> a.num_tokens, a.finish_reason, a.token_ids == b.token_ids
            (6, 'length', True)
        """
        if self._runtime.in_loop():
            raise EngineError("generate_batch blocks; do not call it on the engine's own loop")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.top_logprobs or params.structured_outputs is not None:
            self._check_features(params)
        checked = [self._check_prompt(p, self._backend.vocab_size) for p in prompts]
        if (vision := self._vision) is not None:  # a vision-language model's text prompts
            for i, p in enumerate(checked):
                check_image_prompt(p, 0, vision, f"prompts[{i}]")
        self._state.check_open()
        futures = [self._scope.submit(self._generate(p, params, None)) for p in checked]
        gens = [f.result() for f in futures]
        for i, gen in enumerate(gens if vision is not None else ()):
            check_generation(checked[i], gen, vision, f"prompts[{i}]", False)  # type: ignore[arg-type]
        return gens

    def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating: ``keep`` freezes in-flight requests, ``abort`` ends them with
        finish_reason "abort", ``wait`` lets them finish. New requests wait for resume.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     scripted.pause("abort")
            ...     waiting = scripted.runtime.submit(scripted.generate([1], SamplingParams()))
            ...     print(scripted.pause_mode, waiting.done())
            ...     scripted.resume()
            ...     print(scripted.pause_mode, waiting.result().token_ids)
            abort False
            None (7,)
        """
        self._call(self._pause(check_pause_mode(mode)))

    def resume(self) -> None:
        """Undo ``pause``: frozen and queued requests continue.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     scripted.pause("keep")
            ...     scripted.resume()
            ...     scripted.is_paused, scripted.interruptions
            (False, 2)
        """
        self._call(self._resume())

    def update_weights(self, weights: WeightsLike, version: int | None = None) -> int:
        """Load ``weights`` into the live engine; returns and stores the new version.

        ``version`` defaults to the current version + 1. Tokens produced after the call
        carry the new version.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> with ScriptedEngine(lambda prompt_ids, params: [7]) as scripted:
            ...     print(scripted.update_weights(torch.nn.Linear(2, 2)))  # the next version
            ...     print(scripted.update_weights({"w": torch.zeros(1)}, version=10))
            ...     scripted.generate_batch([[1, 2]], SamplingParams())[0].versions
            1
            10
            (10,)
        """
        check_new_version(version)
        named = named_tensors(weights)
        self._call(self._load_weights(named, version))
        return self._state.version

    def close(self) -> None:
        """Stop the engine; waiting and later ``generate`` calls raise EngineClosedError.

        Every waiting caller is failed at once; the backend then stops, waiting for at
        most the step in flight.

        Examples:
            >>> from rollpipe.engines.scripted import ScriptedEngine
            >>> scripted = ScriptedEngine(lambda prompt_ids, params: [7])
            >>> scripted.close()
            >>> scripted.closed, scripted.alive
            (True, False)
            >>> scripted.generate_batch([[1, 2]], SamplingParams())
            Traceback (most recent call last):
            ...
            rollpipe.engines.records.EngineClosedError: ScriptedEngine is closed; ...
        """
        if not self._state.close():
            return
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
    async def _generate(
        self,
        prompt: list[int] | PromptView,
        params: SamplingParams,
        on_tokens: OnTokens,
        images: tuple[Any, ...] | None = None,
    ) -> Generation:
        # a PromptView only reaches a backend that declared takes_views (see _attach)
        ids = cast(list[int], prompt)
        streams = on_tokens is not None and "on_tokens" in self._features
        if images is not None:  # a vision-language model's backend (Backend.vision)
            backend: Any = self._backend
            gen = await backend.generate(ids, params, on_tokens if streams else None, images=images)
        elif streams:
            gen = await self._backend.generate(ids, params, on_tokens)  # type: ignore[call-arg]
        else:
            gen = await self._backend.generate(ids, params)
        if not self._backend_reports_tokens:  # counted as produced otherwise
            self._produced(len(gen.token_ids))
        if on_tokens is not None and not streams and gen.token_ids:  # all of it, at once
            on_tokens(list(gen.token_ids))
        return gen

    async def _pause(self, mode: PauseMode) -> None:
        async with self._control:
            with self._state.pausing(mode):  # the previous mode comes back if this raises
                await self._backend.pause(mode)

    async def _resume(self) -> None:
        async with self._control:
            with self._state.resuming():
                await self._backend.resume()

    async def _load_weights(
        self, named: list[tuple[str, torch.Tensor]], version: int | None
    ) -> None:
        async with self._control:
            with self._state.updating(version) as new_version:
                # stored on exit, with no await since the load: see Backend.load_weights
                await self._backend.load_weights(named, new_version)

    def __reduce__(self) -> Any:
        """An engine cannot be pickled (a model, an event loop and threads in this process):
        a Ray actor builds its own from a factory (docs/ray-actor.md)."""
        name = type(self).__name__
        raise TypeError(
            f"{name} cannot be pickled: it holds a model, an event loop and threads in this "
            f"process. To run a RolloutPipeline in a Ray actor, pass a factory that builds "
            f"the engine inside the actor: ray.remote(RolloutPipeline).options("
            f"max_concurrency=4).remote(config, functools.partial({name}, path), path) "
            "(see docs/ray-actor.md)"
        )
