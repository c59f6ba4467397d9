"""One streamed front-door call: the engine's ids reach the client as they are produced.

An episode's turn that the engine aborts (a pause with ``mode="abort"``) is generated
again from its prompt (``generate_turn``). A streamed answer cannot be: its first tokens
are already with the client. So here an aborted request **continues**: the next request
is the prompt plus the tokens produced so far, with the budget that is left, and the
answer is the two joined. The row keeps every token as produced, each with the version
that produced it (what a ``keep`` pause gives too); ``clock.aborted_tokens`` stays 0.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from rollpipe.agent.env_caller import Clock
from rollpipe.agent.generation_timeout import answer_within
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.routing import Session, in_session

__all__ = ["streamed_turn"]


async def streamed_turn(
    engine: Engine,
    prompt: Sequence[int],
    params: SamplingParams,
    on_tokens: Callable[[list[int]], None],
    *,
    admit: Callable[[], Awaitable[None]] | None,
    max_aborts: int,
    clock: Clock,
    session: Session,
    limit: float | None = None,
) -> Generation:
    """One engine request whose ids go to ``on_tokens`` as they come; an abort continues
    it (see the module doc). ``admit`` holds each request while the pipeline is
    suspended; ``limit`` is ``generation_timeout_s``."""
    parts: list[Generation] = []
    context = list(prompt)
    budget = params.max_tokens
    aborts = 0
    while True:
        if admit is not None:
            await admit()
        start = time.perf_counter()
        with in_session(session):  # an engine pool keeps the episode on one rank
            request = engine.generate(
                context, params.replace(max_tokens=budget), on_tokens=on_tokens
            )
            gen = await (request if limit is None else answer_within(engine, request, limit))
        clock.engine += time.perf_counter() - start
        parts.append(gen)
        budget -= len(gen.token_ids)
        if gen.finish_reason != "abort":
            return Generation.joined(parts, gen.finish_reason)
        if budget < 1:
            return Generation.joined(parts, "length")
        context.extend(gen.token_ids)
        aborts += 1
        if aborts > max_aborts:
            raise EngineError(
                f"engine aborted the same request {aborts} times in a row; raise max_aborts "
                "or check why the engine keeps aborting (paused with mode='abort'?)"
            )
