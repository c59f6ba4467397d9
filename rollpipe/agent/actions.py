"""AssistantAction: one assistant turn as a chat env receives it — text, content, tool
calls and reasoning, split by the model's own parsers (:mod:`rollpipe.agent.parsers`).

A text env gets the response as a string, as always; an env whose class says
``step_input = "action"`` gets this record instead, so it never parses markup itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from rollpipe._utils.freeze import freeze, thaw

__all__ = ["AssistantAction", "ToolCall"]


_PLAIN = frozenset({str, int, float, bool, type(None)})  # scalars ``thaw`` keeps as they are


def _arguments(value: Any) -> Any:
    return None if value is None else freeze(dict(value))


@attrs.frozen
class ToolCall:
    """One call the model asked for.

    ``id`` is deterministic (``call_{turn}_{index}``), so a re-run episode renders the
    same ids. ``arguments`` holds the decoded JSON object (frozen: key-sorted pairs; use
    :attr:`kwargs`) and ``arguments_json`` the JSON text the parser produced; ``error``
    says why the arguments are unusable (not a JSON object), else ``None``.

    Examples:
        >>> call = ToolCall.from_json("call_0_0", "add", '{"b": 2, "a": 1}')
        >>> call.kwargs, call.error, call.message()["function"]["arguments"]
        ({'a': 1, 'b': 2}, None, '{"b": 2, "a": 1}')
        >>> ToolCall.from_json("call_0_1", "add", "[1, 2]").error
        'arguments must be a JSON object, got list: [1, 2]'
    """

    id: str
    name: str
    arguments_json: str
    arguments: Any = attrs.field(default=None, converter=_arguments)
    error: str | None = None

    @classmethod
    def from_json(cls, call_id: str, name: str, arguments_json: str) -> ToolCall:
        """A call with ``arguments_json`` decoded; a JSON value that is not an object (or
        not JSON) gives a call with ``error`` set instead of ``arguments``."""
        try:
            value = json.loads(arguments_json)
        except ValueError as exc:
            return cls(call_id, name, arguments_json, None, f"arguments are not JSON: {exc}")
        if not isinstance(value, dict):
            problem = f"arguments must be a JSON object, got {type(value).__name__}"
            return cls(call_id, name, arguments_json, None, f"{problem}: {arguments_json}")
        return cls(call_id, name, arguments_json, value)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The arguments as a plain dict (empty when they were unusable)."""
        arguments = self.arguments
        if arguments is None:
            return {}
        if all(type(v) in _PLAIN for _, v in arguments):  # what thaw gives back unchanged
            return dict(arguments)
        return dict(thaw(arguments, "ToolCall"))

    def message(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry of this call (arguments as JSON text)."""
        function = {"name": self.name, "arguments": self.arguments_json}
        return {"id": self.id, "type": "function", "function": function}


def _calls(value: Iterable[ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(value)


def _messages(value: Iterable[Mapping[str, str]]) -> tuple[Mapping[str, str], ...]:
    return tuple(value)


@attrs.frozen
class ToolResults:
    """What running one turn's tool calls gave (``rollpipe.agent.tool_runner``): one
    ``tool`` message per call (one for unreadable call markup), in the calls' order, and
    the turn's counts (``tool/calls``, ``tool/malformed``, ...: step metrics, summed).

    Examples:
        >>> results = ToolResults([dict(tool_message("call_0", "add", "3"))], {"tool/calls": 1.0})
        >>> results.messages[0]["content"], results.counts["tool/calls"]
        ('3', 1.0)
    """

    messages: tuple[Mapping[str, str], ...] = attrs.field(converter=_messages)
    counts: Mapping[str, float] = attrs.field(factory=dict)


@attrs.frozen
class AssistantAction:
    """One assistant turn, parsed.

    ``text``: the response decoded with the special tokens the parsers need (the
    end-of-turn token left out). ``content``: the text without reasoning and call
    markup. ``tool_calls``: the calls parsed, in order. ``parse_error``: set when the
    text holds call markup the tool parser could not read (bad JSON, no name); then
    ``tool_calls`` is empty. ``reasoning``: the reasoning block, where the model has a
    reasoning parser and wrote one. ``tool_results``: what running the calls gave, set
    by the episode before it steps an env that has it run them (``tool_runner``).

    Examples:
        >>> call = ToolCall.from_json("call_0_0", "add", '{"a": 1, "b": 2}')
        >>> action = AssistantAction("Adding.<tool_call>...</tool_call>", "Adding.", [call])
        >>> action.malformed, [c["function"]["name"] for c in action.message()["tool_calls"]]
        (False, ['add'])
        >>> AssistantAction.plain("Left").message()
        {'role': 'assistant', 'content': 'Left'}
        >>> AssistantAction("<tool_call>{", "", parse_error="bad JSON").malformed
        True
    """

    text: str
    content: str
    tool_calls: tuple[ToolCall, ...] = attrs.field(default=(), converter=_calls)
    parse_error: str | None = None
    reasoning: str | None = None
    tool_results: ToolResults | None = attrs.field(default=None, hash=False)

    @property
    def calls_tools(self) -> bool:
        """Whether the turn asks for tools (calls, or call markup that could not be read)."""
        return bool(self.tool_calls) or self.parse_error is not None

    @property
    def malformed(self) -> bool:
        """Whether a call was attempted but cannot run as written."""
        return self.parse_error is not None or any(c.error for c in self.tool_calls)

    def message(self) -> dict[str, Any]:
        """The assistant message a chat template renders for this turn."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [c.message() for c in self.tool_calls]
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        return message

    def with_results(self, results: ToolResults) -> AssistantAction:
        """This action with ``results`` as its ``tool_results`` (built directly: a copy
        or ``attrs.evolve`` costs 3-10 µs a turn).

        Examples:
            >>> action = AssistantAction("<tool_call>...</tool_call>", "")
            >>> done = action.with_results(ToolResults([], {"tool/calls": 0.0}))
            >>> done.tool_results.counts, done.text == action.text, action.tool_results
            ({'tool/calls': 0.0}, True, None)
        """
        return AssistantAction(
            self.text, self.content, self.tool_calls, self.parse_error, self.reasoning, results
        )

    @classmethod
    def plain(cls, text: str) -> AssistantAction:
        """An action with no parser applied: all of ``text`` is content."""
        return cls(text=text, content=text)


def tool_message(call_id: str, name: str, content: str) -> Mapping[str, str]:
    """A ``tool`` message answering call ``call_id`` of tool ``name``."""
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
