"""ToolRunner: runs the tool calls of one assistant turn, each off the event loop with a
time limit, and answers every call with a tool message; a bad call is a message, never
a crash.

Outcomes of one call, each a ``tool`` message and a count (``tool/calls``, and one of
``tool/malformed``, ``tool/errors``, ``tool/timeouts``; each also per tool as
``tool/<kind>/<name>``), reported as step metrics summed over the episode:

* unreadable call markup (bad JSON, no name), an unknown tool, arguments that are not
  an object, miss a required name, have an unknown name or a value of the wrong JSON
  type -> ``malformed``, the message says what was wrong and what the tool takes;
* the tool raises -> ``errors``, the message is the exception's type and text;
* the tool runs past ``timeout_s`` -> ``timeouts`` (its thread is abandoned; see
  :class:`~rollpipe.agent.env_threads.EnvThreads`);
* otherwise the result: a str as it is, anything else as JSON.

Blocking tools run on :class:`~rollpipe.agent.env_threads.EnvThreads` (timed by the
loop's own timer); coroutine tools are awaited with ``asyncio.wait_for``. The calls of
one turn run one after another, in the order the model wrote them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import reprlib
from collections.abc import Mapping
from typing import Any

from rollpipe.agent.actions import AssistantAction, ToolCall, tool_message
from rollpipe.agent.env_threads import EnvThreads, EnvTimeoutError
from rollpipe.agent.tools import ToolSet

__all__ = ["TOOL_METRIC_KINDS", "ToolRunner", "argument_problem"]

TOOL_METRIC_KINDS = ("calls", "malformed", "errors", "timeouts")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, wanted: Any) -> bool:
    names = wanted if isinstance(wanted, list) else [wanted]
    for name in names:
        types = _JSON_TYPES.get(name)
        if types is None:  # a type this check does not know: leave it to the tool
            return True
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, types):
            return True
    return False


def argument_problem(parameters: Mapping[str, Any], kwargs: Mapping[str, Any]) -> str | None:
    """What is wrong with ``kwargs`` for a tool taking ``parameters`` (a JSON schema of
    an object), or ``None``: missing required names, unknown names, wrong JSON types."""
    properties = parameters.get("properties", {}) or {}
    missing = [k for k in parameters.get("required", []) if k not in kwargs]
    if missing:
        return f"missing required argument(s) {missing}"
    if parameters.get("additionalProperties", False) is False:
        unknown = sorted(set(kwargs) - set(properties))
        if unknown:
            return f"unknown argument(s) {unknown}; it takes {sorted(properties)}"
    for name, value in kwargs.items():
        wanted = properties.get(name, {}).get("type")
        if wanted is not None and not _type_ok(value, wanted):
            got = f"{type(value).__name__} {reprlib.repr(value)}"
            return f"argument {name!r} must be of JSON type {wanted}, got {got}"
    return None


def _result_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


class ToolRunner:
    """Runs the calls of an :class:`AssistantAction` with ``tools`` (see the module doc).

    ``timeout_s``: limit of one call (None: none). ``max_threads``: worker threads for
    blocking tools (started on demand; ``close()`` ends them).
    """

    def __init__(
        self, tools: ToolSet, *, timeout_s: float | None = 10.0, max_threads: int = 2
    ) -> None:
        self.tools, self.timeout_s = tools, timeout_s
        self.threads = EnvThreads(max_threads, "rollpipe-tools")

    async def run(self, action: AssistantAction) -> tuple[list[dict[str, str]], dict[str, float]]:
        """One tool message per call (one for unreadable markup), and the counts."""
        counts = dict.fromkeys((f"tool/{k}" for k in TOOL_METRIC_KINDS), 0.0)
        messages: list[dict[str, str]] = []
        if action.parse_error is not None:
            counts["tool/calls"] += 1
            counts["tool/malformed"] += 1
            text = f"error: the tool call could not be read: {action.parse_error}"
            messages.append({"role": "tool", "content": text})
        for call in action.tool_calls:
            kind, text = await self._one(call)
            for key in ("calls", kind) if kind != "calls" else ("calls",):
                counts[f"tool/{key}"] += 1
                counts[f"tool/{key}/{call.name}"] = counts.get(f"tool/{key}/{call.name}", 0) + 1
            messages.append(dict(tool_message(call.id, call.name, text)))
        return messages, counts

    async def _one(self, call: ToolCall) -> tuple[str, str]:
        """``(kind, message text)`` of one call; kind is ``"calls"`` when it ran fine."""
        if call.name not in self.tools.names:
            known = ", ".join(self.tools.names) or "none"
            return "malformed", f"error: unknown tool {call.name!r}; the tools are: {known}"
        if call.error is not None:
            return "malformed", f"error: {call.name}: {call.error}"
        kwargs = call.kwargs
        problem = argument_problem(self.tools.parameters(call.name), kwargs)
        fn = self.tools.functions.get(call.name)
        if problem is None and fn is not None:
            try:
                inspect.signature(fn).bind(**kwargs)
            except TypeError as exc:
                problem = str(exc)
        if problem is not None:
            return "malformed", f"error: {call.name}: {problem}"
        if fn is None:
            return "errors", f"error: tool {call.name!r} has no function to run"
        try:
            if inspect.iscoroutinefunction(fn):
                result = await asyncio.wait_for(fn(**kwargs), self.timeout_s)
            else:
                bound = functools.partial(fn, **kwargs)
                result = await self.threads.call(bound, timeout=self.timeout_s)
        except (TimeoutError, EnvTimeoutError):
            return "timeouts", f"error: {call.name} returned no result within {self.timeout_s} s"
        except Exception as exc:  # the tool's failure is the model's observation
            return "errors", f"error: {call.name} raised {type(exc).__name__}: {exc}"
        return "calls", _result_text(result)

    def close(self) -> None:
        """End the worker threads (a hung tool's thread ends when its call returns)."""
        self.threads.close(0.0)
