"""The one contract between an engine and the backend that generates for it.

``BaseEngine`` owns everything an engine is (its runtime, the policy version, the pause
mode, whether it died or was closed) and drives a ``Backend`` that only generates. A
backend never sees the engine: it gets an ``EngineLink``, callbacks to read the version
and the pause mode the engine owns, to report tokens as they are produced and to report
that it died. Every backend
coroutine runs on the engine's runtime (one event loop), so a backend needs no locks
against its engine; ``BaseEngine`` also runs at most one of ``pause`` / ``resume`` /
``load_weights`` at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import torch

from rollpipe.engines.protocol import PauseMode
from rollpipe.engines.records import Generation, SamplingParams

__all__ = ["Backend", "EngineLink"]


@attrs.frozen
class EngineLink:
    """What a backend may know of its engine.

    ``version()``: the version to label tokens with (read it when a step starts).
    ``pause_mode()``: the mode the engine is paused in, None while it runs; the engine
    sets it before calling ``Backend.pause`` and clears it before ``Backend.resume``.
    ``on_death(error)``: the backend can no longer generate; later calls fail fast.
    ``produced(n)``: the backend produced ``n`` more tokens (any requests), called on the
    loop as they appear. Only a backend whose class sets ``reports_tokens = True`` calls
    it; for any other backend the engine counts each returned generation's tokens instead
    (see ``BaseEngine.tokens_generated``).
    """

    version: Callable[[], int]
    pause_mode: Callable[[], PauseMode | None]
    on_death: Callable[[BaseException], None]
    produced: Callable[[int], None] = lambda n: None


class Backend(Protocol):
    """What an engine drives. Every coroutine runs on the engine's event loop.

    A backend whose class sets ``takes_views = True`` reads prompts as sequences: its
    ``generate`` may get a ``PromptView`` (``rollpipe.engines.inputs``; a read-only,
    fixed ``Sequence[int]`` over an episode's growing context) instead of a list, so a
    turn's prompt reaches it without a copy of the history. Any other backend gets a
    ``list[int]`` of its own; building it is that backend's share of a turn's cost.
    """

    @property
    def vocab_size(self) -> int | None:
        """Prompt ids must be below this (None: not checked)."""
        ...

    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        """One completion of ``prompt`` (already checked; a ``PromptView`` only when the
        backend declares ``takes_views``); queue it while paused.

        Raise ``EngineError`` for a request the backend cannot serve (too long).
        """
        ...

    async def pause(self, mode: PauseMode) -> None:
        """Act on ``mode`` (already set): ``keep`` returns once no step runs, ``abort``
        once in-flight and queued requests ended with "abort", ``wait`` once they finished."""
        ...

    async def resume(self) -> None:
        """Continue frozen requests and start queued ones (the mode is already None)."""
        ...

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Load ``named`` into the live model, between two steps.

        The engine stores ``version`` as soon as this returns, with nothing else running
        on the loop in between: a step that waited for the load reads the new version.
        """
        ...

    async def shutdown(self, error: BaseException) -> None:
        """Fail what still waits with ``error`` and stop; wait for at most the step in
        flight. Runs during ``close``, after every caller has been failed already."""
        ...

    def release(self) -> None:
        """Free what is left (threads, memory), from the closing thread, after the loop
        stopped."""
        ...
