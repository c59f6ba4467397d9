"""ResponseParser: the model's own tool-call and reasoning parsers, chosen by name.

rollpipe writes no parser: ``tool_parser`` names one of vLLM's (``vllm.tool_parsers``:
``hermes``, ``llama3_json``, ``mistral``, ``qwen3_coder``, ...; ``hf`` uses the response
template the tokenizer defines) and ``reasoning_parser`` one of ``vllm.reasoning``'s
(``qwen3``, ``deepseek_r1``, ...), exactly as ``vllm serve --tool-call-parser`` /
``--reasoning-parser`` would. Reasoning is split off first, then calls are read from the
rest.

vLLM's parsers answer unreadable call markup by logging the exception and returning the
text as content. Here that becomes ``AssistantAction.parse_error``: the logged exception
(caught by a filter on the parser's logger, for this thread only, and not printed) or,
when the text holds the parser's start marker and nothing was logged, a note saying so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from rollpipe.agent.actions import AssistantAction, ToolCall

__all__ = ["ResponseParser", "call_id", "renumbered"]

_MARKER_ATTRS = ("tool_calls_start_token", "tool_call_start_token", "bot_token")


def call_id(turn: int, index: int) -> str:
    """The id of call ``index`` of turn ``turn``: deterministic, so re-runs match."""
    return f"call_{turn}_{index}"


def renumbered(action: AssistantAction, turn: int) -> AssistantAction:
    """``action`` as :meth:`ResponseParser.parse` gives it at ``turn``: the same parse, its
    calls with that turn's ids (the only part of a parse that follows the turn).

    Examples:
        >>> call = ToolCall.from_json(call_id(0, 0), "add", '{"a": 1}')
        >>> moved = renumbered(AssistantAction("...", "", [call]), turn=3)
        >>> [(c.id, c.kwargs) for c in moved.tool_calls]
        [('call_3_0', {'a': 1})]
    """
    if not action.tool_calls:
        return action
    calls = [attrs.evolve(c, id=call_id(turn, i)) for i, c in enumerate(action.tool_calls)]
    return attrs.evolve(action, tool_calls=calls)


class _Capture(logging.Filter):
    """Holds back the records a parser logs on the thread that is parsing, and keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        records = getattr(self.local, "records", None)
        if records is None:
            return True
        records.append(record)
        return False


_CAPTURES: dict[str, _Capture] = {}
_CAPTURES_LOCK = threading.Lock()


def _capture_for(logger_name: str) -> _Capture:
    with _CAPTURES_LOCK:
        capture = _CAPTURES.get(logger_name)
        if capture is None:
            capture = _CAPTURES[logger_name] = _Capture()
            logging.getLogger(logger_name).addFilter(capture)
        return capture


def _logged_error(records: Sequence[logging.LogRecord]) -> str | None:
    for record in records:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            return f"{type(error).__name__}: {error}"
    return records[0].getMessage() if records else None


def _registered(kind: str, name: str, manager: Any) -> type:
    get = manager.get_tool_parser if kind == "tool" else manager.get_reasoning_parser
    try:
        return get(name)  # type: ignore[no-any-return]
    except KeyError:
        known = ", ".join(manager.list_registered())
        raise ValueError(
            f"{kind}_parser={name!r} is not one of vLLM's {kind} parsers; use one of: {known}"
        ) from None


class ResponseParser:
    """Splits a decoded response into an :class:`AssistantAction` with vLLM's parsers.

    Args:
        tokenizer: the model's Hugging Face tokenizer (the parsers look up their marker
            tokens in it; a parser whose markers are missing fails here, naming them).
        tool_parser: a name in ``vllm.tool_parsers.ToolParserManager`` or ``None``.
        reasoning_parser: a name in ``vllm.reasoning.ReasoningParserManager`` or ``None``.
        tools: the OpenAI tool schemas of the request (some parsers read argument types).

    Examples:
        >>> from transformers import AutoTokenizer
        >>> from rollpipe.training.tiny_model import default_model_path
        >>> tools_tokenizer = AutoTokenizer.from_pretrained(default_model_path(tools=True))
        >>> parser = ResponseParser(tools_tokenizer, tool_parser="hermes")
        >>> text = 'Adding.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        >>> action = parser.parse(text, turn=2)
        >>> action.content, [(c.id, c.name, c.kwargs) for c in action.tool_calls]
        ('Adding.', [('call_2_0', 'add', {'a': 1})])
        >>> parser.parse("<tool_call>{oops</tool_call>").parse_error
        'JSONDecodeError: ...'
    """

    def __init__(
        self,
        tokenizer: Any,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        tools: Sequence[dict[str, Any]] = (),
    ) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.tool_parser_name, self.reasoning_parser_name = tool_parser, reasoning_parser
        request: Any = ChatCompletionRequest
        self._request = request(messages=[], model="rollpipe", tools=list(tools) or None)
        self._tools: Any = None
        self._reasoning: Any = None
        if tool_parser is not None:
            from vllm.tool_parsers import ToolParserManager

            cls = _registered("tool", tool_parser, ToolParserManager)
            self._tools = _built(cls, tokenizer, "tool_parser", tool_parser)
        if reasoning_parser is not None:
            from vllm.reasoning import ReasoningParserManager

            cls = _registered("reasoning", reasoning_parser, ReasoningParserManager)
            self._reasoning = _built(cls, tokenizer, "reasoning_parser", reasoning_parser)
        markers = (getattr(self._tools, a, None) for a in _MARKER_ATTRS)
        self.marker: str | None = next((m for m in markers if isinstance(m, str) and m), None)

    def parse(self, text: str, turn: int = 0) -> AssistantAction:
        """``text`` (decoded with special tokens) as an action; calls get ids of ``turn``."""
        reasoning, rest = None, text
        if self._reasoning is not None:
            reasoning, content = self._call(self._reasoning, "extract_reasoning", text)[0]
            rest = content or ""
        if self._tools is None:
            return AssistantAction(text, rest, reasoning=reasoning)
        info, logged = self._call(self._tools, "extract_tool_calls", rest)
        if info.tools_called and info.tool_calls:
            calls = [
                ToolCall.from_json(call_id(turn, i), c.function.name, c.function.arguments or "{}")
                for i, c in enumerate(info.tool_calls)
            ]
            return AssistantAction(text, info.content or "", calls, reasoning=reasoning)
        error = logged
        if error is None and self.marker is not None and self.marker in rest:
            error = f"{self.marker} found but the {self.tool_parser_name} parser read no call"
        content = rest if info.content is None else info.content
        return AssistantAction(text, content, parse_error=error, reasoning=reasoning)

    def _call(self, parser: Any, method: str, text: str) -> tuple[Any, str | None]:
        capture = _capture_for(type(parser).__module__)
        records: list[logging.LogRecord] = []
        capture.local.records = records
        try:
            result = getattr(parser, method)(text, self._request)
        finally:
            capture.local.records = None
        return result, _logged_error(records)


def _built(cls: type, tokenizer: Any, field: str, name: str) -> Any:
    try:
        return cls(tokenizer)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ValueError(
            f"{field}={name!r} does not fit this tokenizer: {exc}; pick the parser of the "
            "model's family (its tokenizer must hold the parser's marker tokens)"
        ) from exc
