"""DriverEngine: the engine as an episode worker sees it — every request goes to the driver.

An episode worker runs episodes exactly as the driver would (``run_spec``), on its own
runtime, with this object as their engine. ``generate`` sends a :class:`~.mail.Request`
(the prompt, the sampling, the images, the conversation's route) and awaits the
driver's :class:`~.mail.Answer`: the driver admits it (a suspended pipeline holds it),
routes it in its engine pool (the route's rank comes back and is kept here, so an
episode stays on its rank) and applies ``generation_timeout_s`` where pauses are known.
Pausing, resuming and weight updates are the driver's: called here they raise.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from rollpipe.engines.inputs import CheckedIds, PromptView
from rollpipe.engines.protocol import OnTokens
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.routing import current_route
from rollpipe.runtime import Runtime
from rollpipe.workers.mail import Abandon, Answer, Request

__all__ = ["FEATURES", "DriverEngine"]

FEATURES: tuple[str, ...] = ("top_logprobs", "structured_outputs", "images")
"""The driver engine's features a worker's engine reports as its own (``on_tokens`` is
not one: a worker gets each response whole, and passes it on at once)."""


class DriverEngine:
    """The :class:`~rollpipe.engines.protocol.Engine` of an episode worker's episodes.

    ``send`` posts a message to the driver (the worker's outbox); ``features`` are those of
    :data:`FEATURES` the driver's engine supports.
    """

    def __init__(
        self, runtime: Runtime, features: frozenset[str], send: Callable[[Any], None]
    ) -> None:
        self._runtime, self._features, self._send = runtime, features, send
        self._numbers = itertools.count()
        self._waiting: dict[int, asyncio.Future[Answer]] = {}
        self._version = 0
        self._closed: BaseException | None = None

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    @property
    def version(self) -> int:
        """The newest policy version seen in an answer (the driver's engine owns it)."""
        return self._version

    @property
    def is_paused(self) -> bool:
        return False  # the driver holds requests while paused; none waits here

    @property
    def interruptions(self) -> int:
        return 0  # generation_timeout_s is applied on the driver, where pauses are known

    def supports(self, feature: str) -> bool:
        return feature in self._features

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_tokens: OnTokens = None,
        images: Sequence[Any] = (),
    ) -> Generation:
        """Ask the driver's engine; ``on_tokens`` gets the whole response once, at the end."""
        if self._closed is not None:
            raise self._closed
        route = current_route()
        req = next(self._numbers)
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._waiting[req] = answer
        # a checked prompt pickles as a CheckedIds with its bounds: the driver's engine
        # then checks it by them, not id by id (as an in-process episode's prompt)
        checked = type(prompt_ids) in (PromptView, CheckedIds)
        self._send(
            Request(
                req,
                prompt_ids if checked else list(prompt_ids),  # type: ignore[arg-type]
                params,
                tuple(images),
                None if route is None else route.key,
                None if route is None else route.rank,
            )
        )
        try:
            got = await answer
        except asyncio.CancelledError:
            if self._waiting.pop(req, None) is not None:
                self._send(Abandon(req))  # the driver stops generating it
            raise
        if route is not None:
            route.rank = got.rank
        if got.error is not None:
            raise got.error
        gen = got.generation
        assert gen is not None  # an answer holds a generation or an error
        if gen.versions:
            self._version = max(self._version, gen.versions[-1])
        if on_tokens is not None and gen.token_ids:
            on_tokens(list(gen.token_ids))
        return gen

    def answered(self, answer: Answer) -> None:
        """The driver's answer to one request (a late one, for a request abandoned, is dropped)."""
        waiting = self._waiting.pop(answer.req, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)

    def generate_batch(self, prompts: Any, params: SamplingParams) -> list[Generation]:
        raise EngineError("generate_batch is the driver's: call it on the pipeline's engine")

    def pause(self, mode: Any = "abort") -> None:
        raise EngineError("pause the pipeline (suspend) on the driver, not in an episode worker")

    def resume(self) -> None:
        raise EngineError("resume the pipeline on the driver, not in an episode worker")

    def update_weights(self, weights: Any, version: int | None = None) -> int:
        raise EngineError("update the weights on the driver (RolloutPipeline.update_weights)")

    def close(self, error: BaseException | None = None) -> None:
        """Fail every request still waiting (the worker is closing)."""
        self._closed = error or EngineError("the episode worker closed")
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(self._closed)

    def __enter__(self) -> DriverEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
