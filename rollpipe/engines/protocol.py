"""The generation protocol every engine satisfies: token ids in, token ids out.

``Engine`` is what the rollout stage talks to; ``PauseMode`` names the three ways to
pause one. The records it exchanges (``SamplingParams``, ``Generation``) and its errors
live in ``records.py``; ``BaseEngine`` (``base.py``) implements it on a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.runtime import Runtime

__all__ = [
    "DEFAULT_UPDATE_WEIGHTS_TIMEOUT_S",
    "PAUSE_MODES",
    "Engine",
    "OnTokens",
    "PauseMode",
    "WeightsLike",
    "engine_supports",
]

PauseMode = Literal["keep", "abort", "wait"]
"""``keep``: in-flight requests freeze and continue after resume; ``abort``: they end
with finish_reason "abort"; ``wait``: they finish. New requests wait for resume."""

PAUSE_MODES: tuple[PauseMode, ...] = ("keep", "abort", "wait")

OnTokens = Callable[[list[int]], None] | None
"""``generate(..., on_tokens=f)``: ``f(ids)`` gets each piece of the response's token ids
as the engine produces them, in order, on the engine's loop (the front door streams them).
Engines that produce a response at once call it once, with all its ids, before returning."""

DEFAULT_UPDATE_WEIGHTS_TIMEOUT_S = 600.0
"""How long a remote engine's (Ray actor, vLLM server) ``update_weights`` may take before
it counts as stalled: the call fails and the engine is marked dead."""

WeightsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | torch.nn.Module
"""What ``update_weights`` accepts: a state dict, (name, tensor) pairs, or a module."""


@runtime_checkable
class Engine(Protocol):
    """What the rollout stage needs from a generation backend."""

    @property
    def version(self) -> int:
        """The policy version of the weights the engine generates with now."""
        ...

    @property
    def is_paused(self) -> bool: ...

    @property
    def interruptions(self) -> int:
        """Pauses, resumes and weight updates so far: each may hold requests on purpose
        (``generation_timeout_s`` starts again after one)."""
        ...

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_tokens: OnTokens = None,
        images: Sequence[Any] = (),
    ) -> Generation:
        """``images``: all of the conversation's images so far, one image pad id each in
        ``prompt_ids``, for an engine that ``supports("images")`` (``BaseEngine.generate``)."""
        ...

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]: ...

    def pause(self, mode: PauseMode = "abort") -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, weights: WeightsLike, version: int | None = None) -> int: ...

    def close(self) -> None: ...

    @property
    def runtime(self) -> Runtime:
        """The event loop the engine runs on; episodes run there too (no thread hop)."""
        ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc: object) -> None: ...


def engine_supports(engine: Engine, feature: str) -> bool:
    """Whether ``engine`` says it honours ``feature`` (its ``supports(feature)``); an
    engine without that method supports none of the optional features."""
    supports = getattr(engine, "supports", None)
    return bool(supports(feature)) if callable(supports) else False
