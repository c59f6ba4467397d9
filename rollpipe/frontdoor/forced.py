"""Forced tool calls: ``tool_choice`` ``"required"`` or a named function, as vLLM does them.

``vllm serve`` picks how to force a call by the model's tool parser, and so does the
front door (:func:`forced_outputs`):

- a parser with an xgrammar structural tag (``hermes`` and others, while vLLM's
  ``VLLM_ENFORCE_STRICT_TOOL_CALLING`` is on, its default) constrains the answer to the
  model's own call markup (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``),
  read back by the parser as any answer is;
- otherwise, the answer is constrained to the JSON schema vLLM's server builds
  (``vllm.tool_parsers.utils.get_json_schema_from_tools``): a named function's arguments
  object, or for ``"required"`` a list of ``{"name", "parameters"}`` calls, read back by
  :func:`forced_action` (no tool parser is needed);
- a parser that reads forced calls its own way without a tag gets no constraint.

The engine applies the constraint (``SamplingParams.structured_outputs``); the rows keep
exactly the tokens the model sampled under it.
"""

from __future__ import annotations

import json
from typing import Any

from rollpipe.agent.actions import AssistantAction, ToolCall
from rollpipe.agent.parsers import call_id
from rollpipe.frontdoor.requests import ChatRequest

__all__ = ["forced_action", "forced_outputs", "vllm_request"]


def vllm_request(request: ChatRequest) -> Any:
    """``request`` as vLLM's ``ChatCompletionRequest`` (its tools and tool choice), which
    vLLM's parsers read."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    choice: Any = request.tool_choice
    if choice == "function":
        choice = {"type": "function", "function": {"name": request.tool_name}}
    make: Any = ChatCompletionRequest  # pydantic: the tool dicts are validated into models
    return make(
        messages=[],
        model="rollpipe",
        tools=[dict(t) for t in request.tools] or None,
        tool_choice=choice if request.tools else None,
        parallel_tool_calls=request.parallel_tool_calls,
        include_reasoning=True,
    )


def forced_outputs(
    request: ChatRequest, tokenizer: Any, parser_cls: Any
) -> tuple[dict[str, Any] | None, bool]:
    """The structured outputs that force ``request``'s call (None: none) and whether the
    answer is then JSON for :func:`forced_action` (else the tool parser reads it)."""
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    wanted = vllm_request(request)
    if parser_cls is not None:
        parser = parser_cls(tokenizer, wanted.tools)
        tools = parser.tool_parser
        if tools is not None and not tools.supports_required_and_named:
            outputs = parser.adjust_request(wanted).structured_outputs
            tag = None if outputs is None else outputs.structural_tag
            return ({"structural_tag": tag} if tag else None), False
    schema = get_json_schema_from_tools(
        wanted.tool_choice, wanted.tools, wanted.parallel_tool_calls
    )
    return {"json": schema}, True


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
