"""Lookup: a tool task whose answer the model cannot know without the call, offline.

Each episode fills nine drawers with random digits (from the seed) and asks for the
digit in one of them. The ``lookup`` tool opens a drawer; nothing in the question says
what is inside, so an answer given without the call is right one time in ten (chance).
The verifier rewards 1.0 when the answer's last number is the digit.

It is the task the tools warm start learns and ``rollpipe train --env lookup`` trains
(docs/learning.md): one short argument to copy into the call, one digit to copy from
the tool's answer, so a small model can do it, and the call is what pays.
``lookup_env(tool_available=False)`` answers every call with "the drawers are locked":
the same task with the tool's information taken away, to measure what the tool is worth.

Example::

    env = lookup_env()
    prompt, info = env.reset(seed=3)  # "Which digit is in drawer 7? ..."
"""

from __future__ import annotations

import random
from typing import Any

from rollpipe.envs.calculator import last_number_matches
from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT, ToolEnv

__all__ = ["DRAWERS", "LOCKED", "LookupEnv", "lookup_env", "lookup_task"]

DRAWERS = 9
"""Drawers per episode, numbered 1 to 9 (one token each)."""
LOCKED = "The drawers are locked."
"""What the tool says when ``tool_available=False``."""


def lookup_task(seed: int) -> tuple[str, tuple[int, list[int]]]:
    """``(question, (drawer, digits))`` for ``seed``: the drawer asked about and the nine
    drawers' digits (``digits[drawer - 1]`` is the answer)."""
    rng = random.Random(seed)
    digits = [rng.randrange(10) for _ in range(DRAWERS)]
    drawer = rng.randint(1, DRAWERS)
    question = f"Which digit is in drawer {drawer}? Use the lookup tool, then answer."
    return question, (drawer, digits)


class LookupEnv(ToolEnv):
    """The lookup task as a :class:`ToolEnv` (see the module doc)."""

    def __init__(
        self,
        tool_available: bool = True,
        max_tool_turns: int = 2,
        system_prompt: str | None = DEFAULT_TOOL_PROMPT,
    ) -> None:
        if not isinstance(tool_available, bool):
            raise ValueError(
                f"lookup_env: tool_available must be True or False, got {tool_available!r}"
            )
        self.tool_available = tool_available
        self._digits: list[int] = []
        super().__init__(
            self._task,
            [self.lookup],
            self._verify,
            max_tool_turns=max_tool_turns,
            system_prompt=system_prompt,
        )

    def _task(self, seed: int) -> tuple[str, int]:
        question, (drawer, self._digits) = lookup_task(seed)
        return question, self._digits[drawer - 1]

    @staticmethod
    def _verify(answer: str, truth: Any) -> float:
        return last_number_matches(answer, truth)

    def lookup(self, drawer: int) -> str:
        """Open a drawer and read the digit inside.

        Args:
            drawer: the drawer's number, 1 to 9
        """
        if not self.tool_available:
            return LOCKED
        if not isinstance(drawer, int) or not 1 <= drawer <= DRAWERS:
            raise ValueError(f"drawer must be an integer from 1 to {DRAWERS}, got {drawer!r}")
        return str(self._digits[drawer - 1])


def lookup_env(
    tool_available: bool = True,
    max_tool_turns: int = 2,
    system_prompt: str | None = DEFAULT_TOOL_PROMPT,
) -> LookupEnv:
    """The lookup task (module doc); the registry builds it as ``"lookup"``."""
    return LookupEnv(tool_available, max_tool_turns, system_prompt)
