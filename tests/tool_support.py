"""Shared pieces of the tool-calling tests: the tiny model's tools variant, a scripted
engine (for tests about parsing and rows, where the model's text must be chosen), and
example tools."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.training.tiny_model import default_model_path


def tools_model_path() -> Path:
    """The tiny model's tool-calling variant (hermes-style template, marker tokens)."""
    return default_model_path(tools=True)


class ScriptedEngine:
    """Answers each request with the next scripted text's ids and records every prompt:
    the model's text is the test's input, the rest of the episode is real."""

    version = 0
    is_paused = False
    interruptions = 0

    def __init__(self, tokenizer: Any, texts: Sequence[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.prompts: list[list[int]] = []
        self.responses: list[list[int]] = []

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, on_tokens: Any = None
    ) -> Generation:
        text = self.texts[len(self.prompts)] if len(self.prompts) < len(self.texts) else "done"
        self.prompts.append(list(prompt_ids))
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        ids = ids[: params.max_tokens]
        eot = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        reason = "stop" if ids and ids[-1] == eot else "length"
        self.responses.append(ids)
        if on_tokens is not None and ids:  # the whole answer at once, as the protocol allows
            on_tokens(list(ids))
        return Generation(ids, [-0.5] * len(ids), reason, [0] * len(ids))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


RELEASE = threading.Event()  # set by the tests that use hang, at their end


def hang(seconds: int) -> str:
    """Wait until released (a tool that never returns in time).

    Args:
        seconds: ignored
    """
    RELEASE.wait()
    return "late"


def call(name: str, **arguments: Any) -> str:
    """The text of one hermes call, as the tools template renders it."""
    import json

    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@contextlib.contextmanager
def recording(engine: Any, entry: Callable[[Any, Any, Any], Any]) -> Iterator[Any]:
    """``engine`` with each request recorded at its boundary while the block runs:
    ``engine.seen`` gets ``entry(prompt_ids, params, generation)`` per request; the
    shared engine's own ``generate`` is back afterwards."""
    generate = engine.generate
    engine.seen = []

    async def recorded(prompt_ids: Any, params: Any, **kw: Any) -> Any:
        gen = await generate(prompt_ids, params, **kw)
        engine.seen.append(entry(prompt_ids, params, gen))
        return gen

    engine.generate = recorded
    try:
        yield engine
    finally:
        del engine.generate, engine.seen  # the shared engine's own method again
