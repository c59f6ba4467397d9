"""Calculator: a procedural arithmetic task that needs a calculator tool, offline.

``calculator_env(seed-free settings)`` builds a :class:`~rollpipe.envs.tool_env.ToolEnv`:
each seed gives a product or sum of multi-digit numbers (hard to do in one's head, easy
with the tool); the tool evaluates arithmetic by walking Python's AST (numbers, ``+ - *
/ // % **`` and parentheses only: no names, calls or attributes, so it never runs code);
the verifier rewards 1.0 when the last number in the answer equals the result.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT, ToolEnv

__all__ = [
    "DEFAULT_TOOL_PROMPT",  # the system prompt of its episodes (ToolEnv's)
    "calculate",
    "calculator_env",
    "calculator_task",
    "last_number_matches",
]

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_POWER = 64
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_POWER})")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, got {ast.dump(node)}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 3) * 4"
    """
    value = _value(ast.parse(expression, mode="eval").body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def calculator_task(seed: int, digits: int = 3) -> tuple[str, int]:
    """``(prompt, result)`` for ``seed``: a product or sum of two ``digits``-digit numbers."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    op, result = (" * ", a * b) if rng.random() < 0.5 else (" + ", a + b)
    prompt = f"What is {a}{op.strip() and op}{b}? Use the calculate tool, then give the number."
    return prompt, result


def last_number_matches(answer: str, truth: Any) -> float:
    """1.0 when the last number in ``answer`` equals ``truth``, else 0.0."""
    numbers = _NUMBER.findall(answer)
    return float(bool(numbers) and float(numbers[-1]) == float(truth))


def calculator_env(
    digits: int = 3,
    max_tool_turns: int = 3,
    tool_timeout_s: float | None = 5.0,
    system_prompt: str | None = DEFAULT_TOOL_PROMPT,
) -> ToolEnv:
    """The calculator task as a :class:`ToolEnv` (see the module doc); ``system_prompt``
    as in :class:`ToolEnv`.

    Examples:
        >>> import asyncio
        >>> from rollpipe.agent.actions import AssistantAction
        >>> env = calculator_env(digits=2)
        >>> prompt, info = env.reset(seed=0)
        >>> env.tools.names, prompt == calculator_task(0, digits=2)[0]
        (('calculate',), True)
        >>> answer = AssistantAction.plain(f"It is {calculator_task(0, digits=2)[1]}.")
        >>> asyncio.run(env.step(answer))[1:3]  # reward, terminated
        (1.0, True)
        >>> env.close()
    """
    if not isinstance(digits, int) or not 1 <= digits <= 12:
        raise ValueError(f"calculator_env: digits must be an int in [1, 12], got {digits!r}")
    return ToolEnv(
        lambda seed: calculator_task(seed, digits),
        [calculate],
        last_number_matches,
        max_tool_turns=max_tool_turns,
        tool_timeout_s=tool_timeout_s,
        system_prompt=system_prompt,
    )
