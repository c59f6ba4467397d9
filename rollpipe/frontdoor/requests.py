"""ChatRequest: a ``/v1/chat/completions`` body, checked field by field.

Every problem is a :class:`RequestError` naming the field (OpenAI's ``param``) and what
to send instead; the server answers it as OpenAI-style error JSON with status 400.
Messages are normalised to the plain dicts a chat template reads (``role``, ``content``
as text (a user message with ``image_url`` parts: rollpipe's content parts, the images
decoded by ``images.py``), ``tool_calls`` with JSON-text arguments, ``tool_call_id``,
``name``, ``reasoning_content``), so the same conversation compares equal however the client
serialised it (``content=None`` or ``""``, extra ``refusal`` / ``annotations`` fields).

Fields that would change how the server renders (``chat_template``,
``chat_template_kwargs``, ...) are refused: the model's own template is the only one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from rollpipe.frontdoor.images import ImagePartError, decode_image_part

__all__ = ["ChatRequest", "RequestError", "normalise_message", "parse_chat_request"]

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
RENDERING = (
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "echo",
)
"""Fields that would change how a request is rendered: refused."""
UNSUPPORTED = ("response_format", "guided_json", "guided_regex", "logit_bias", "functions")
UNSUPPORTED_NONZERO = ("presence_penalty", "frequency_penalty")


class RequestError(ValueError):
    """A request the server refuses: ``status`` (400, 401, 404), OpenAI's ``param``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.kind, self.code = kind, code

    def body(self) -> dict[str, Any]:
        """OpenAI's error JSON."""
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}


@attrs.frozen
class ChatRequest:
    """What the server uses of a request. ``sampling`` holds the request's own
    sampling fields (``SamplingParams`` names), applied over the server's defaults."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"  # "auto", "none", "required" or "function" (a named one)
    tool_name: str | None = None  # the function a "function" choice names
    parallel_tool_calls: bool | None = None
    sampling: Mapping[str, Any] = attrs.field(factory=dict)
    logprobs: bool = False
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    raw_messages: list[Any] = attrs.field(factory=list, eq=False, repr=False)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a str, None, or a list of ``text`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                also = " (image_url parts go in user messages)" if _is_image(part) else ""
                raise RequestError(
                    f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}}{also}",
                    f"{where}[{i}]",
                )
            parts.append(_part_text(part, f"{where}[{i}]"))
        return "".join(parts)
    raise RequestError(
        f"{where} must be a string, null or a list of text parts, got {type(content).__name__}",
        where,
    )


def _is_image(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_url"


def _part_text(part: Mapping[str, Any], where: str) -> str:
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text must be a string", f"{where}.text")
    return str(part["text"])


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user message's content: text (as :func:`_text`), or, when it holds
    ``image_url`` parts, rollpipe's content parts (``rollpipe.agent.content``) with each
    image decoded (``images.py``: ``data:`` URLs only)."""
    if not isinstance(content, list) or not any(_is_image(p) for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if _is_image(part):
            try:
                parts.append({"type": "image", "image": decode_image_part(part, at)})
            except ImagePartError as exc:
                raise RequestError(str(exc), exc.param) from exc
        elif isinstance(part, Mapping) and part.get("type") == "text":
            parts.append({"type": "text", "text": _part_text(part, at)})
        else:
            raise RequestError(
                f"{at} must be a text part {{'type': 'text', 'text': ...}} or an image part "
                "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}",
                at,
            )
    return parts


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise RequestError(
            f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
            where,
        )
    fn = call["function"]
    name, arguments = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise RequestError(
            f"{where}.function.name must be a non-empty string", f"{where}.function.name"
        )
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def normalise_message(message: Any, where: str) -> dict[str, Any]:
    """``message`` as the plain dict the template renders (see the module doc)."""
    if not isinstance(message, Mapping):
        raise RequestError(f"{where} must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role is {role!r}; use one of {ROLES}", f"{where}.role")
    content, at = message.get("content"), f"{where}.content"
    out: dict[str, Any] = {
        "role": role,
        "content": _user_content(content, at) if role == "user" else _text(content, at),
    }
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise RequestError(
                f"{where}.tool_calls must be a list, on an assistant message", f"{where}.tool_calls"
            )
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
            out[key] = value
    return out


def _tool(tool: Any, where: str) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or tool.get("type", "function") != "function":
        raise RequestError(
            f"{where} must be {{'type': 'function', 'function': {{'name', "
            "'description', 'parameters'}}}",
            where,
        )
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(
            f"{where}.function.name must be a non-empty string", f"{where}.function.name"
        )
    if "parameters" in fn and not isinstance(fn["parameters"], Mapping):
        raise RequestError(
            f"{where}.function.parameters must be a JSON schema object",
            f"{where}.function.parameters",
        )
    return {"type": "function", "function": dict(fn)}


def _number(
    body: Mapping[str, Any], key: str, low: float, high: float, integer: bool = False
) -> Any:
    value = body[key]
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"{key} must be {kind} in [{low}, {high}], got {value!r}", key)
    return value


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            sampling["max_tokens"] = _number(body, key, 1, 2**31, integer=True)
    if body.get("temperature") is not None:
        sampling["temperature"] = float(_number(body, "temperature", 0.0, 2.0))
    if body.get("top_p") is not None:
        sampling["top_p"] = float(_number(body, "top_p", 1e-9, 1.0))
    if body.get("top_k") is not None:
        top_k = _number(body, "top_k", -1, 2**31, integer=True)
        sampling["top_k"] = max(0, top_k)  # vLLM's -1 and rollpipe's 0 both mean off
    if body.get("seed") is not None:
        sampling["seed"] = _number(body, "seed", 0, 2**63 - 1, integer=True)
    if body.get("ignore_eos") is not None:  # vLLM's extra field
        sampling["ignore_eos"] = _flag(body, "ignore_eos")
    return sampling


def _check_unsupported(body: Mapping[str, Any]) -> None:
    for key in RENDERING:
        if body.get(key) is not None:
            raise RequestError(
                f"{key} is not accepted: this server renders every request "
                "with the model's own chat template; leave it out",
                key,
            )
    for key in UNSUPPORTED:
        if body.get(key) is not None:
            raise RequestError(f"{key} is not supported by this server; leave it out", key)
    for key in UNSUPPORTED_NONZERO:
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(f"{key} is not supported; leave it out or send 0", key)
    if body.get("n") not in (None, 1):
        raise RequestError(f"n={body.get('n')!r}: one choice per request; send n=1", "n")


def _stop(value: Any) -> tuple[str, ...]:
    """``stop``: a string or a list of up to 4 non-empty strings (OpenAI's bounds)."""
    stops = [value] if isinstance(value, str) else value
    if value is None or value == []:
        return ()
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4:
        raise RequestError(
            f"stop must be a string or a list of 1 to 4 strings, got {value!r}", "stop"
        )
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop[{i}] must be a non-empty string, got {s!r}", "stop")
    return tuple(stops)


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    """``tool_choice`` as (``"auto"`` / ``"none"`` / ``"required"`` / ``"function"``, the
    named function or None); a forced choice needs ``tools`` holding it."""
    if value is None or value in ("auto", "none"):
        return value or "auto", None
    names = [t["function"]["name"] for t in tools]
    if value == "required":
        if not tools:
            raise RequestError("tool_choice='required' needs tools; send some", "tool_choice")
        return "required", None
    fn = value.get("function") if isinstance(value, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or value.get("type", "function") != "function":
        raise RequestError(
            f"tool_choice={value!r}: use one of {TOOL_CHOICES} or "
            "{'type': 'function', 'function': {'name': <a tool's name>}}",
            "tool_choice",
        )
    if name not in names:
        raise RequestError(
            f"tool_choice names function {name!r}, which is not in tools ({names})",
            "tool_choice",
        )
    return "function", name


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key) or False
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {value!r}", key)
    return value


def _messages(messages: list[Any], known: ChatRequest | None) -> tuple[dict[str, Any], ...]:
    """``messages`` normalised; those that repeat ``known``'s (an earlier request of the
    session: an agent resends its whole history) are taken from it, not checked again."""
    head: tuple[dict[str, Any], ...] = ()
    if known is not None:
        n = len(known.raw_messages)
        if len(messages) >= n and messages[:n] == known.raw_messages:
            head = known.messages
    start = len(head)
    tail = (normalise_message(m, f"messages[{i}]") for i, m in enumerate(messages[start:], start))
    return head + tuple(tail)


def parse_chat_request(body: Any, known: ChatRequest | None = None) -> ChatRequest:
    """``body`` (decoded JSON) as a :class:`ChatRequest`; :class:`RequestError` naming
    the first field that is wrong. ``known``: the session's last request, whose messages
    need no second check where this one repeats them."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object", None)
    if not isinstance(body.get("model"), str):
        raise RequestError("model must be a string (any name: the server has one model)", "model")
    _check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of chat messages", "messages")
    checked = _messages(messages, known)
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", "tools")
    checked_tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    choice, name = _tool_choice(body.get("tool_choice"), checked_tools)
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
    sampling = _sampling(body)
    if body.get("top_logprobs") is not None:
        sampling["top_logprobs"] = _number(body, "top_logprobs", 0, 20, integer=True)
        if sampling["top_logprobs"] and not logprobs:
            raise RequestError("top_logprobs needs logprobs=true; send both", "top_logprobs")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(
            f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls"
        )
    stream, options = body.get("stream") or False, body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    if not isinstance(options, Mapping):
        raise RequestError("stream_options must be an object", "stream_options")
    return ChatRequest(
        messages=checked,
        tools=checked_tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=parallel,
        sampling=sampling,
        logprobs=logprobs,
        return_token_ids=_flag(body, "return_token_ids"),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        stop=_stop(body.get("stop")),
        raw_messages=messages,
    )
