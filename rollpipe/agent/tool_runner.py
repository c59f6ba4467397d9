"""ToolRunner: runs the tool calls of one assistant turn, each off the event loop with a
time limit, and answers every call with a tool message; a bad call is a message, never
a crash. The episode calls it (``run_episode``, for an env that declares a
``tool_runner``), then steps the env with the action and its
:class:`~rollpipe.agent.actions.ToolResults`: an env says what the calls mean for the
episode (reward, turn limit), it does not run them.

Outcomes of one call, each a ``tool`` message and a count (``tool/calls``, and one of
``tool/malformed``, ``tool/errors``, ``tool/timeouts``; each also per tool as
``tool/<kind>/<name>``), reported as step metrics summed over the episode:

* unreadable call markup (bad JSON, no name), an unknown tool, arguments that are not
  an object, miss a required name, have an unknown name or a value of the wrong JSON
  type -> ``malformed``, the message says what was wrong and what the tool takes;
* the tool raises -> ``errors``, the message is the exception's type and text;
* the tool runs past ``timeout_s`` -> ``timeouts`` (its thread is abandoned; see
  :class:`~rollpipe.agent.env_threads.EnvThreads`);
* otherwise the result: a str as it is, anything else as JSON, cut to
  ``max_result_chars`` characters (the cut counted as ``tool/cut``; None: no limit), so
  one huge result cannot flood the prompt.

A tool may also return an image (a ``PIL.Image`` or an ``H x W x 3`` uint8 array) or a
list of content parts (``rollpipe.agent.content``: text and images). Its tool message
then holds the text parts (joined; the cut applies to them only) and the turn's images
follow in ONE ``user`` message after the turn's tool messages, in the calls' order: the
env contract takes content parts in user messages only, and every vision template
renders an image in a user message (Qwen2-VL's would show one in a tool message too).
The episode's image conversation renders them (an engine that supports images).

Blocking tools run on :class:`~rollpipe.agent.env_threads.EnvThreads` (timed by the
loop's own timer), their results made into message text (JSON, the cut) there too, so a
huge result costs only its own episode; coroutine tools are awaited with
``asyncio.wait_for``; a tool declared ``blocking = False`` (``rollpipe.agent.tools.
runs_inline``: fast and pure, as the calculator) runs inline, cheaper than the thread
hop; a turn whose calls all run inline (or cannot run) is answered at once
(``ToolRunner.run_inline``: no await, no timer). The calls of one turn run one after
another, in the order the model wrote them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import reprlib
import time
from collections.abc import Mapping
from typing import Any

from rollpipe.agent.actions import AssistantAction, ToolCall, ToolResults, tool_message
from rollpipe.agent.content import ContentPart, check_parts, is_image
from rollpipe.agent.env_caller import SLOW_INLINE_S
from rollpipe.agent.env_contract import EnvStateError
from rollpipe.agent.env_threads import EnvThreads, EnvTimeoutError
from rollpipe.agent.tools import ToolSet

__all__ = [
    "DEFAULT_MAX_RESULT_CHARS",
    "TOOL_METRIC_KINDS",
    "ToolRunner",
    "argument_problem",
    "results_of",
]

_log = logging.getLogger(__name__)
_SLOW_INLINE_REPORTED: set[str] = set()
TOOL_METRIC_KINDS = ("calls", "malformed", "errors", "timeouts", "cut")
DEFAULT_MAX_RESULT_CHARS = 16_000
"""A tool result's length limit in characters (about 4k tokens), as verl's
``max_tool_response_length`` bounds a tool response."""
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


def _result_parts(result: Any, where: str) -> tuple[str, list[ContentPart]] | None:
    """A result's text and images when it is an image or a list of content parts (the
    text parts joined), else None; ``ContentError`` for a malformed parts list."""
    if is_image(result):
        return "", [{"type": "image", "image": result}]
    if not (isinstance(result, list) and result and isinstance(result[0], dict)):
        return None
    if not any(isinstance(p, dict) and p.get("type") == "image" for p in result):
        return None  # a list of plain dicts: JSON, as before
    parts = check_parts(result, where)
    text = "".join(p["text"] for p in parts if p["type"] == "text")
    return text, [p for p in parts if p["type"] == "image"]


def _result_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


Shown = tuple[str, str, list[ContentPart], bool]
"""One call's outcome: its kind (``"calls"`` when it ran fine), its message text, its
images, and whether the text was cut to ``max_result_chars``."""


def _failed(kind: str, text: str) -> Shown:
    return kind, text, [], False  # cut (if too long) by ToolRunner.run


def shown(name: str, result: Any, limit: int | None) -> Shown:
    """The outcome of tool ``name`` returning ``result``: its text (a str as it is, else
    JSON) cut to ``limit`` characters, and its images; ``errors`` for a malformed parts
    list (the tool's bug, told to the model)."""
    if type(result) is str:  # the usual result: no parts to look for
        text, cut = _cut(result, limit)
        return "calls", text, [], cut
    try:
        found = _result_parts(result, f"{name}'s result")
    except ValueError as exc:
        return _failed("errors", f"error: {name} returned {exc}")
    text, images = (_result_text(result), []) if found is None else found
    text, cut = _cut(text, limit)
    return "calls", text, images, cut


def _cut(text: str, limit: int | None) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters (a note saying so after it), and whether it was."""
    if limit is None or len(text) <= limit:
        return text, False
    return f"{text[:limit]}\n[tool result cut to {limit} of {len(text)} characters]", True


def _run_shown(fn: Any, kwargs: dict[str, Any], name: str, limit: int | None) -> Shown:
    """On a tool thread: run the tool and make its message text there."""
    return shown(name, fn(**kwargs), limit)


def _check_inline_time(fn: Any, name: str, elapsed: float) -> None:
    """Report, once per tool, an inline tool (``blocking = False``) that ran longer than
    ``SLOW_INLINE_S``: every episode waited meanwhile."""
    if elapsed > SLOW_INLINE_S and name not in _SLOW_INLINE_REPORTED:
        _SLOW_INLINE_REPORTED.add(name)
        _log.warning(
            "tool %r declares blocking = False but one call took %.3f s inline on the event "
            "loop, stalling every episode meanwhile; remove that declaration so its calls "
            "run on tool threads, under tool_timeout_s (reported once per tool)",
            name,
            elapsed,
        )


_METRIC_KEYS = tuple(f"tool/{k}" for k in TOOL_METRIC_KINDS)
_COUNTED: dict[tuple[str, str, bool], tuple[str, ...]] = {}


def _counted(kind: str, name: str, cut: bool) -> tuple[str, ...]:
    """The counts one call of tool ``name`` adds to: ``calls``, its kind unless it ran
    fine, ``cut``; each also per tool (``tool/calls/<name>``). Kept per (kind, name,
    cut): the same few every turn."""
    found = _COUNTED.get((kind, name, cut))
    if found is None:
        kinds = ("calls",) if kind == "calls" else ("calls", kind)
        kinds = (*kinds, "cut") if cut else kinds
        found = tuple(key for k in kinds for key in (f"tool/{k}", f"tool/{k}/{name}"))
        if len(_COUNTED) >= 4096:  # tool names the model made up: bounded
            _COUNTED.clear()
        _COUNTED[(kind, name, cut)] = found
    return found


class ToolRunner:
    """Runs the calls of an :class:`AssistantAction` with ``tools`` (see the module doc).

    ``timeout_s``: limit of one call (None: none). ``max_threads``: worker threads for
    blocking tools (started on demand; ``close()`` ends them). ``max_result_chars``: a
    result longer than this is cut (None: no limit).

    Examples:
        >>> import asyncio
        >>> from rollpipe.envs.calculator import calculate
        >>> runner = ToolRunner(ToolSet([calculate]), max_result_chars=1)
        >>> call = ToolCall.from_json("call_0", "calculate", '{"expression": "6 * 7"}')
        >>> results = asyncio.run(runner.run(AssistantAction("", "", [call])))
        >>> results.messages[0]["content"], results.counts["tool/cut"]
        ('4\\n[tool result cut to 1 of 2 characters]', 1.0)
        >>> runner.close()
    """

    def __init__(
        self,
        tools: ToolSet,
        *,
        timeout_s: float | None = 10.0,
        max_threads: int = 2,
        max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS,
    ) -> None:
        if max_result_chars is not None and (
            not isinstance(max_result_chars, int) or max_result_chars < 1
        ):
            raise ValueError(
                f"ToolRunner.max_result_chars must be an int >= 1 or None (no limit), "
                f"got {max_result_chars!r}"
            )
        self.tools, self.timeout_s = tools, timeout_s
        self.max_result_chars = max_result_chars
        self.threads = EnvThreads(max_threads, "rollpipe-tools")
        # each call's check by id (the call kept with it): a group's episodes share the
        # parsed actions of the turns they repeat (``rollpipe.agent.repeats``), and a
        # check is a function of the call and the tools alone
        self._checks: dict[int, tuple[ToolCall, Shown | None]] = {}

    async def run(self, action: AssistantAction) -> ToolResults:
        """One tool message per call (one for unreadable markup), and the counts."""
        now = self.run_inline(action)
        if now is not None:
            return now
        return self._results(action, [await self._one(call) for call in action.tool_calls])

    def run_inline(self, action: AssistantAction) -> ToolResults | None:
        """:meth:`run`'s results, made at once where no call waits (each runs inline, or
        cannot run: a bad call); None where one must be awaited (a blocking or coroutine
        tool). The episode asks this first: such a turn needs no await and no timer (an
        inline tool runs on the loop, where no timer can stop it anyway)."""
        checked = []
        for call in action.tool_calls:  # first see that none waits, then run them
            kwargs = call.kwargs
            problem = self._checked(call, kwargs)
            if problem is None and call.name not in self.tools.inline:
                return None
            checked.append((call.name, kwargs, problem))
        outcomes = [
            self._ran_inline(name, kwargs) if problem is None else problem
            for name, kwargs, problem in checked
        ]
        return self._results(action, outcomes)

    def _results(self, action: AssistantAction, outcomes: list[Shown]) -> ToolResults:
        """The tool messages and counts of ``action``'s calls, given each one's outcome."""
        counts = dict.fromkeys(_METRIC_KEYS, 0.0)
        messages: list[dict[str, Any]] = []
        images: list[ContentPart] = []  # the calls' images, shown after their messages
        if action.parse_error is not None:
            counts["tool/calls"] += 1
            counts["tool/malformed"] += 1
            text = f"error: the tool call could not be read: {action.parse_error}"
            messages.append({"role": "tool", "content": text})
        for call, (kind, text, pictures, cut) in zip(action.tool_calls, outcomes, strict=True):
            if kind != "calls":  # an error message: bounded like a result
                text, cut = _cut(text, self.max_result_chars)
            images.extend(pictures)
            for key in _counted(kind, call.name, cut):
                counts[key] = counts.get(key, 0) + 1
            messages.append(dict(tool_message(call.id, call.name, text)))
        if images:
            messages.append({"role": "user", "content": images})
        return ToolResults(messages, counts)

    async def _one(self, call: ToolCall) -> Shown:
        """``(kind, message text, images, cut)`` of one call; kind is ``"calls"`` when it
        ran fine. A blocking tool's result is also made into its message text (JSON,
        cut) on its thread: a huge result costs only its own episode."""
        kwargs = call.kwargs
        problem = self._checked(call, kwargs)
        if problem is not None:
            return problem
        if call.name in self.tools.inline:  # declared fast: cheaper than a thread hop
            return self._ran_inline(call.name, kwargs)
        fn, name = self.tools.functions[call.name], call.name
        limit = self.max_result_chars
        try:
            if inspect.iscoroutinefunction(fn):
                return shown(name, await asyncio.wait_for(fn(**kwargs), self.timeout_s), limit)
            run = functools.partial(_run_shown, fn, kwargs, name, limit)
            result: Shown = await self.threads.call(run, timeout=self.timeout_s)
            return result
        except (TimeoutError, EnvTimeoutError):
            return self._late(name)
        except Exception as exc:  # the tool's failure is the model's observation
            return _failed("errors", f"error: {name} raised {type(exc).__name__}: {exc}")

    def _ran_inline(self, name: str, kwargs: dict[str, Any]) -> Shown:
        """The outcome of running tool ``name`` (declared ``blocking = False``) here."""
        fn = self.tools.functions[name]
        try:
            start = time.perf_counter()
            outcome = shown(name, fn(**kwargs), self.max_result_chars)
            _check_inline_time(fn, name, time.perf_counter() - start)
            return outcome
        except (TimeoutError, EnvTimeoutError):
            return self._late(name)
        except Exception as exc:  # the tool's failure is the model's observation
            return _failed("errors", f"error: {name} raised {type(exc).__name__}: {exc}")

    def _late(self, name: str) -> Shown:
        return _failed("timeouts", f"error: {name} returned no result within {self.timeout_s} s")

    def _checked(self, call: ToolCall, kwargs: dict[str, Any]) -> Shown | None:
        """:meth:`_problem`, kept for the same call object (at most 4096 kept)."""
        found = self._checks.get(id(call))
        if found is not None and found[0] is call:
            return found[1]
        problem = self._problem(call, kwargs)
        if len(self._checks) >= 4096:
            self._checks.clear()
        self._checks[id(call)] = (call, problem)
        return problem

    def _problem(self, call: ToolCall, kwargs: dict[str, Any]) -> Shown | None:
        """The ``malformed`` (or ``errors``: nothing to run) outcome of a call with
        ``kwargs`` that cannot run as written, else None."""
        if call.name not in self.tools.names:
            known = ", ".join(self.tools.names) or "none"
            unknown = f"error: unknown tool {call.name!r}; the tools are: {known}"
            return _failed("malformed", unknown)
        if call.error is not None:
            return _failed("malformed", f"error: {call.name}: {call.error}")
        problem = argument_problem(self.tools.parameters(call.name), kwargs)
        fn = self.tools.functions.get(call.name)
        if problem is None and fn is not None and call.name not in self.tools.bound_by_schema:
            try:
                self.tools.signature(call.name).bind(**kwargs)
            except TypeError as exc:
                problem = str(exc)
        if problem is not None:
            return _failed("malformed", f"error: {call.name}: {problem}")
        if fn is None:
            return _failed("errors", f"error: tool {call.name!r} has no function to run")
        return None

    def close(self) -> None:
        """End the worker threads (a hung tool's thread ends when its call returns)."""
        self.threads.close(0.0)


def results_of(
    action: AssistantAction, env: object
) -> tuple[list[dict[str, str]], dict[str, float]]:
    """The tool messages and counts of ``action``'s calls, which the episode ran before it
    stepped ``env`` (an env with a ``tool_runner``); an ``EnvStateError`` naming what to do
    when they were not run.

    Examples:
        >>> action = AssistantAction("", "", [ToolCall.from_json("c", "add", "{}")])
        >>> results_of(action, object())
        Traceback (most recent call last):
        rollpipe.agent.env_contract.EnvStateError: object.step got 1 tool call(s) without ...
    """
    if action.tool_results is None:
        calls = len(action.tool_calls) or 1
        raise EnvStateError(
            f"{type(env).__name__}.step got {calls} tool call(s) without their results: "
            "the episode runs them (run_episode does); stepping the env by hand, run "
            "`results = await env.tool_runner.run(action)` and pass "
            "`attrs.evolve(action, tool_results=results)`"
        )
    return [dict(m) for m in action.tool_results.messages], dict(action.tool_results.counts)
