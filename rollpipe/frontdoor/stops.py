"""Stop strings: a response cut where the first of the request's ``stop`` strings ends.

The ``Engine`` protocol has no stop strings, so the engine generates to its end-of-turn
token or ``max_tokens``; the front door then keeps the tokens up to the one that
completes the first stop string to appear (the model's own tokens, a prefix of what it
sampled, with their logprobs and versions) and answers the text before the stop string,
as vLLM and OpenAI do. The session records those tokens: the next call's prompt
continues from them, so the row is still exactly what the engine received. The tokens
sampled after the stop string are dropped (generation time spent for nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from rollpipe.engines.records import Generation

__all__ = ["cut_at_stop"]


def _first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the text before the first-completed stop string ends, or None."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    return min(ends)[1] if ends else None


def cut_at_stop(
    gen: Generation, stop: Sequence[str], decode: Callable[[list[int]], str]
) -> tuple[Generation, str | None]:
    """``gen`` cut after the token that completes the first stop string, and the text
    before that string; ``(gen, None)`` when no stop string appears."""
    ids = list(gen.token_ids)
    if not stop or _first_stop(decode(ids), stop) is None:
        return gen, None
    low, high = 1, len(ids)  # the fewest tokens whose text holds a stop string
    while low < high:
        mid = (low + high) // 2
        if _first_stop(decode(ids[:mid]), stop) is None:
            low = mid + 1
        else:
            high = mid
    text = decode(ids[:low])
    at = _first_stop(text, stop)
    assert at is not None
    cut = attrs.evolve(
        gen,
        token_ids=gen.token_ids[:low],
        logprobs=gen.logprobs[:low],
        finish_reason="stop",
        versions=gen.versions[:low],
        top_logprobs=gen.top_logprobs[:low],
    )
    return cut, text[:at]
