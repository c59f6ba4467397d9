"""ScriptedEngine: the ``Engine`` protocol with a policy function instead of a model.

Every request is answered at once by ``policy(prompt_ids, params) -> token ids`` (a
baseline policy: scripted or random actions). ``prompt_ids`` is a read-only
``Sequence[int]`` (an episode's ``PromptView``, shared without a copy; ``list(...)`` for
a list of one's own). Everything else is a real engine's: its own
runtime, policy versions on every token, pause modes, weight updates (the weights are
ignored), close. Use it where rollpipe is what is measured or tested and the model is
not: ``bench/turn_cost.py`` measures rollpipe's own cost per turn with it, since the
engine then costs nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch

from rollpipe.engines.backend import EngineLink
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.protocol import PauseMode
from rollpipe.engines.records import Generation, SamplingParams

__all__ = ["ScriptedEngine"]

Policy = Callable[[Sequence[int], SamplingParams], Sequence[int]]


class _ScriptedBackend:
    """Answers at once; while paused, new requests wait for resume (none is ever in
    flight across an await, so every pause mode has nothing to freeze or abort)."""

    vocab_size = None
    takes_views = True  # the policy reads the prompt; nothing here needs a list

    def __init__(self, link: EngineLink, policy: Policy) -> None:
        self.link, self.policy = link, policy
        self._running = asyncio.Event()
        self._running.set()
        self._closed: BaseException | None = None

    async def generate(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        await self._running.wait()  # set unless paused
        if self._closed is not None:
            raise self._closed
        ids = list(self.policy(prompt, params))[: params.max_tokens]
        # the first stop token ends it (kept): found at C speed, one pass per stop id
        cut = min((ids.index(t) + 1 for t in params.stop_token_ids if t in ids), default=None)
        reason = "stop" if cut is not None else "length"
        ids = ids if cut is None else ids[:cut]
        n, version = len(ids), self.link.version()
        return Generation(ids, [0.0] * n, reason, [version] * n)

    async def pause(self, mode: PauseMode) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        return None

    async def shutdown(self, error: BaseException) -> None:
        self._closed = error  # what still waits for a resume fails with it
        self._running.set()

    def release(self) -> None:
        return None


class ScriptedEngine(BaseEngine):
    """An engine whose every answer is ``policy(prompt_ids, params)`` (see the module doc).

    A response is cut at ``params.max_tokens`` and after the first of
    ``params.stop_token_ids`` (finish reason ``"stop"``, else ``"length"``); its
    log-probs are 0.0.

    Examples:
        >>> def echo(prompt_ids, params):  # the prompt back, then token 2
        ...     return [*prompt_ids, 2]
        >>> with ScriptedEngine(echo) as scripted:
        ...     stop = scripted.generate_batch([[5, 6]], SamplingParams(stop_token_ids=2))[0]
        ...     cut = scripted.generate_batch([[5, 6]], SamplingParams(max_tokens=1))[0]
        >>> stop.token_ids, stop.finish_reason, cut.token_ids, cut.finish_reason
        ((5, 6, 2), 'stop', (5,), 'length')
    """

    def __init__(self, policy: Policy, *, name: str = "scripted-engine") -> None:
        super().__init__(name=name)
        self.policy = policy

        async def start(link: EngineLink) -> _ScriptedBackend:
            return _ScriptedBackend(link, policy)

        self._attach(start, "a policy function")
