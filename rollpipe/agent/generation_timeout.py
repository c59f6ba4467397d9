"""A time limit on one engine request (``PipelineConfig.generation_timeout_s``).

Optional (default: no limit): an engine that stops answering one request (a stuck
server, a request that never ends) would otherwise hold its episode, and its group,
forever. Over the limit the request is cancelled, which aborts it in the
engine, and the episode ends as errored with the reason, like an env that timed out.

A paused engine holds requests on purpose (``suspend`` while the trainer updates the
weights), so a request fails only once ``limit`` seconds pass in a row in which the
engine was never paused, resumed or given new weights (``Engine.interruptions``): a
limit that runs out after one of those starts again. The limit is the loop's own timer:
nothing polls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import Generation

__all__ = ["GenerationTimeoutError", "answer_within"]


class GenerationTimeoutError(TimeoutError):
    """An engine request did not answer within ``generation_timeout_s`` (``limit``)."""

    def __init__(self, limit: float) -> None:
        super().__init__(f"no answer within {limit} s")
        self.limit = limit

    def __reduce__(self) -> tuple[type, tuple[float]]:  # pickles whole (Ray, processes)
        return type(self), (self.limit,)


async def answer_within(
    engine: Engine, request: Awaitable[Generation], limit: float | None
) -> Generation:
    """``await request``, or GenerationTimeoutError once ``limit`` seconds pass without
    an answer and without a pause, resume or weight update of ``engine`` (None: no
    limit). A request that ends early either way (timed out, or its episode cancelled)
    is cancelled."""
    if limit is None:
        return await request
    task = asyncio.ensure_future(request)
    try:
        while True:
            interruptions = engine.interruptions
            done, _ = await asyncio.wait({task}, timeout=limit)
            if done:
                return task.result()
            if not engine.is_paused and engine.interruptions == interruptions:
                raise GenerationTimeoutError(limit)
    finally:
        if not task.done():
            task.cancel()  # the engine aborts a cancelled request
