"""generate_turn: one turn's engine request, sent again while the engine aborts it.

An engine paused with ``mode="abort"`` ends its requests with ``finish_reason ==
"abort"``; the turn then asks again (after ``admit()``, which holds it while the pipeline
is paused), up to ``max_aborts`` times in a row. Each request is made in the episode's
routing session (``rollpipe.engines.routing``), so an engine pool keeps the episode on
the rank that holds its prefix.

An episode's turn is generated again from its prompt. A streamed turn (``on_tokens``,
the front door's ``stream=true``) cannot be: its first tokens are already with the
client. It **continues** instead: the next request is the prompt plus the tokens
produced so far, with the budget left, and the answer is the parts joined, each token
with the version that produced it (what a ``keep`` pause gives too).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from rollpipe.agent.env_caller import Clock
from rollpipe.agent.generation_timeout import answer_within
from rollpipe.engines.protocol import Engine, OnTokens
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.routing import Route, current_route, in_route

__all__ = ["generate_turn"]


async def generate_turn(
    engine: Engine,
    prompt: Sequence[int],
    params: SamplingParams,
    admit: Callable[[], Awaitable[None]] | None,
    max_aborts: int,
    clock: Clock,
    session: Route,
    limit: float | None = None,
    on_tokens: OnTokens = None,
) -> Generation:
    """One engine request, sent again when the engine aborts it (see the module doc).

    ``admit()`` holds the re-sent request until the pipeline resumes; without a gate it
    goes straight back to the engine, which queues it until its own ``resume()``. The
    request is made in ``session`` (``run_episode`` enters it once for the whole episode;
    another caller's request enters it here). ``on_tokens`` gets the ids as produced.
    """
    aborts = 0
    parts: list[Generation] = []  # a streamed turn's aborted pieces
    while True:
        if admit is not None:
            await admit()
        start = time.perf_counter()
        if current_route() is session:  # the caller's task runs in it already
            gen = await _request(engine, prompt, params, limit, on_tokens)
        else:
            with in_route(session):  # an engine pool keeps the episode on one rank
                gen = await _request(engine, prompt, params, limit, on_tokens)
        clock.engine += time.perf_counter() - start
        if gen.finish_reason != "abort":
            return Generation.joined([*parts, gen], gen.finish_reason) if parts else gen
        if on_tokens is None:
            clock.aborted_tokens += len(gen.token_ids)
        elif gen.token_ids:  # continue from what is already out
            parts.append(gen)
            left = params.max_tokens - len(gen.token_ids)
            if left < 1:
                return Generation.joined(parts, "length")
            prompt, params = [*prompt, *gen.token_ids], params.replace(max_tokens=left)
        aborts += 1
        if aborts > max_aborts:
            raise EngineError(
                f"engine aborted the same request {aborts} times in a row; raise max_aborts "
                "or check why the engine keeps aborting (paused with mode='abort'?)"
            )


def _request(
    engine: Engine,
    prompt: Sequence[int],
    params: SamplingParams,
    limit: float | None,
    on_tokens: OnTokens,
) -> Awaitable[Generation]:
    """The engine request (``on_tokens`` passed only when set: engines written before it
    keep working), within ``limit`` if one is set."""
    if on_tokens is None:
        request = engine.generate(prompt, params)
    else:
        request = engine.generate(prompt, params, on_tokens=on_tokens)
    return request if limit is None else answer_within(engine, request, limit)
