"""Forced tool calls: ``tool_choice`` ``"required"`` or a named function, as vLLM does them.

``vllm serve`` picks how to force a call by the model's tool parser, and so does the
front door (:func:`forced_outputs`):

- a parser with an xgrammar structural tag (``hermes`` and others, while vLLM's
  ``VLLM_ENFORCE_STRICT_TOOL_CALLING`` is on, its default) constrains the answer to the
  model's own call markup (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``),
  read back by the parser as any answer is. Unlike ``vllm serve``'s default, which
  leaves the arguments free unless the tool says ``"strict": true``, the arguments are
  held to the tool's ``parameters`` schema (vLLM's ``--tool-strict-level parameter``):
  the OpenAI API always returns an object;
- otherwise, the answer is constrained to the JSON schema vLLM's server builds
  (``vllm.tool_parsers.utils.get_json_schema_from_tools``): a named function's arguments
  object, or for ``"required"`` a list of ``{"name", "parameters"}`` calls, read back by
  :func:`forced_action` (no tool parser is needed);
- a parser that reads forced calls its own way without a tag gets no constraint.

A tool without ``parameters`` (or with a schema that names no type) takes arguments of
``{"type": "object"}``. The engine applies the constraint
(``SamplingParams.structured_outputs``); the rows keep exactly the tokens the model
sampled under it, marked ``Turn.constrained`` (their logprobs are the grammar-masked
distribution's, not the policy's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rollpipe.agent.actions import AssistantAction, ToolCall
from rollpipe.agent.parsers import call_id
from rollpipe.frontdoor.requests import ChatRequest, RequestError

__all__ = ["forced_action", "forced_outputs", "object_tools", "vllm_request"]


def vllm_request(request: ChatRequest, tools: Any = None) -> Any:
    """``request`` as vLLM's ``ChatCompletionRequest`` (its tools, or ``tools`` instead,
    and tool choice), which vLLM's parsers read."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    choice: Any = request.tool_choice
    if choice == "function":
        choice = {"type": "function", "function": {"name": request.tool_name}}
    make: Any = ChatCompletionRequest  # pydantic: the tool dicts are validated into models
    return make(
        messages=[],
        model="rollpipe",
        tools=[dict(t) for t in (request.tools if tools is None else tools)] or None,
        tool_choice=choice if request.tools else None,
        parallel_tool_calls=request.parallel_tool_calls,
        include_reasoning=True,
    )


def forced_outputs(
    request: ChatRequest, tokenizer: Any, parser_cls: Any
) -> tuple[dict[str, Any] | None, bool]:
    """The structured outputs that force ``request``'s call (None: none) and whether the
    answer is then JSON for :func:`forced_action` (else the tool parser reads it)."""
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    wanted = vllm_request(request, object_tools(request.tools))
    if parser_cls is not None:
        parser = parser_cls(tokenizer, wanted.tools)
        parser.tool_strict_level = ToolStrictLevel.PARAMETER  # every tool as if strict
        tools = parser.tool_parser
        if tools is not None and not tools.supports_required_and_named:
            outputs = parser.adjust_request(wanted).structured_outputs
            tag = None if outputs is None else outputs.structural_tag
            return ({"structural_tag": tag} if tag else None), False
    schema = get_json_schema_from_tools(
        wanted.tool_choice, wanted.tools, wanted.parallel_tool_calls
    )
    return {"json": schema}, True


def object_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``tools`` with each function's ``parameters`` an object schema: ``{"type":
    "object"}`` where missing, its ``type`` set where the schema names none;
    ``RequestError`` naming the tool for a schema of another type (OpenAI's arguments are
    always an object)."""
    out = []
    for i, tool in enumerate(tools):
        function = dict(tool["function"])
        schema = dict(function.get("parameters") or {})
        kind = schema.setdefault("type", "object")
        if kind != "object":
            where = f"tools[{i}].function.parameters"
            raise RequestError(
                f"{where} has type {kind!r}; a forced call's arguments are a JSON object: "
                "give the function an object schema (its arguments as properties)",
                where,
            )
        out.append({**tool, "function": {**function, "parameters": schema}})
    return out


def _leading_json(text: str) -> tuple[Any, str]:
    """The JSON value at the start of ``text`` and its text (an end-of-sequence token
    or whitespace after it is left out); ``ValueError`` if there is none."""
    body = text.lstrip()
    value, end = json.JSONDecoder().raw_decode(body)
    return value, body[:end]


def forced_action(text: str, choice: str, name: str | None, turn: int) -> AssistantAction:
    """The calls in a forced response's JSON ``text``, read as vLLM's server reads them:
    a named choice is one call whose arguments are the text; ``"required"`` is the list's
    calls, each one's ``parameters`` as JSON text. An answer that is not that JSON (cut
    short by ``max_tokens``, say) is malformed: a named call keeps its unusable
    arguments (``ToolCall.error``); ``"required"`` has no call and ``parse_error``."""
    try:
        value, raw = _leading_json(text)
    except ValueError:
        value, raw = None, text.strip()
    if choice == "function":
        assert name is not None
        return AssistantAction(text, "", [ToolCall.from_json(call_id(turn, 0), name, raw)])
    calls = value if isinstance(value, list) else None
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        error = f"tool_choice='required' wants a list of {{'name', 'parameters'}}: {raw[:200]}"
        return AssistantAction(text, "", parse_error=error)
    arguments = [json.dumps(c.get("parameters"), ensure_ascii=False) for c in calls]
    return AssistantAction(
        text,
        "",
        [
            ToolCall.from_json(call_id(turn, i), c["name"], args)
            for i, (c, args) in enumerate(zip(calls, arguments, strict=True))
        ],
    )
