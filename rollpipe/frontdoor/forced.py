"""Forced tool calls: ``tool_choice`` ``"required"`` or a named function, as vLLM does them.

The response is constrained to JSON by the engine's structured outputs
(``SamplingParams.json_schema``), with the schema vLLM's own server builds
(``vllm.tool_parsers.utils.get_json_schema_from_tools``): a named function's arguments
object, or for ``"required"`` a list of ``{"name", "parameters"}`` calls. The model's
answer is therefore that JSON, not its chat format's call markup, exactly as from
``vllm serve``; the rows keep the tokens it sampled. :func:`forced_action` reads the
calls back from the JSON (no tool parser is needed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rollpipe.agent.actions import AssistantAction, ToolCall
from rollpipe.agent.parsers import call_id

__all__ = ["forced_action", "forced_schema"]


def forced_schema(
    tools: Sequence[dict[str, Any]], choice: str, name: str | None, parallel: bool | None
) -> str:
    """The JSON schema (as text) a forced ``choice`` constrains the response to."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    tool_choice: Any = choice
    if choice == "function":
        tool_choice = {"type": "function", "function": {"name": name}}
    make: Any = ChatCompletionRequest  # pydantic: the tool dicts are validated into models
    request = make(
        messages=[],
        model="rollpipe",
        tools=[dict(t) for t in tools],
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
    )
    schema = get_json_schema_from_tools(
        request.tool_choice, request.tools, request.parallel_tool_calls
    )
    return json.dumps(schema)


def _leading_json(text: str) -> tuple[Any, str]:
    """The JSON value at the start of ``text`` and its text (an end-of-sequence token
    or whitespace after it is left out); ``ValueError`` if there is none."""
    body = text.lstrip()
    value, end = json.JSONDecoder().raw_decode(body)
    return value, body[:end]


def forced_action(text: str, choice: str, name: str | None, turn: int) -> AssistantAction:
    """The calls in a forced response's JSON ``text``; ``parse_error`` when it is not the
    JSON the schema asked for (cut short by ``max_tokens``, say)."""
    try:
        value, raw = _leading_json(text)
    except ValueError as exc:
        return AssistantAction(text, text, parse_error=f"the forced tool call is not JSON: {exc}")
    if choice == "function":
        assert name is not None
        return AssistantAction(text, "", [ToolCall.from_json(call_id(turn, 0), name, raw)])
    calls = value if isinstance(value, list) else None
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        error = f"tool_choice='required' wants a list of {{'name', 'parameters'}}: {raw[:200]}"
        return AssistantAction(text, text, parse_error=error)
    return AssistantAction(
        text,
        "",
        [
            ToolCall.from_json(call_id(turn, i), c["name"], json.dumps(c.get("parameters", {})))
            for i, c in enumerate(calls)
        ],
    )
