"""generate_turn: one turn's engine request, re-sent while the engine aborts it.

An engine paused with ``mode="abort"`` ends its requests with ``finish_reason ==
"abort"``; the turn then asks again (after ``admit()``, which holds it while the pipeline
is paused), up to ``max_aborts`` times in a row. Each request is made in the episode's
routing session (``rollpipe.engines.routing``), so an engine pool keeps the episode on
the rank that holds its prefix.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from rollpipe.agent.env_caller import Clock
from rollpipe.agent.generation_timeout import answer_within
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.routing import Session, current_session, in_session

__all__ = ["generate_turn"]


async def generate_turn(
    engine: Engine,
    prompt: Sequence[int],
    params: SamplingParams,
    admit: Callable[[], Awaitable[None]] | None,
    max_aborts: int,
    clock: Clock,
    session: Session,
    limit: float | None = None,
) -> Generation:
    """One engine request, re-sent when the engine aborts it (paused with ``abort``).

    ``admit()`` holds the re-sent request until the pipeline resumes; without a gate it
    goes straight back to the engine, which queues it until its own ``resume()``. The
    request is made in ``session`` (``run_episode`` enters it once for the whole episode;
    another caller's request enters it here).
    """
    aborts = 0
    while True:
        if admit is not None:
            await admit()
        start = time.perf_counter()
        if current_session() is session:  # the caller's task runs in it already
            request = engine.generate(prompt, params)
            gen = await (request if limit is None else answer_within(engine, request, limit))
        else:
            with in_session(session):  # an engine pool keeps the episode on one rank
                request = engine.generate(prompt, params)
                gen = await (request if limit is None else answer_within(engine, request, limit))
        clock.engine += time.perf_counter() - start
        if gen.finish_reason != "abort":
            return gen
        clock.aborted_tokens += len(gen.token_ids)
        aborts += 1
        if aborts > max_aborts:
            raise EngineError(
                f"engine aborted the same request {aborts} times in a row; raise max_aborts "
                "or check why the engine keeps aborting (paused with mode='abort'?)"
            )
