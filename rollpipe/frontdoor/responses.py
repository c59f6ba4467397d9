"""The JSON the front door answers with: OpenAI's ``chat.completion`` and model list."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rollpipe.agent.actions import AssistantAction
from rollpipe.engines.records import Generation

__all__ = ["completion_body", "models_body", "stream_chunks"]


def models_body(name: str) -> dict[str, Any]:
    """``/v1/models``: the one model this server generates with."""
    model = {"id": name, "object": "model", "created": 0, "owned_by": "rollpipe"}
    return {"object": "list", "data": [model]}


def _logprobs(tokenizer: Any, gen: Generation) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(gen.token_ids, gen.logprobs, strict=False):
        text = str(tokenizer.decode([token_id], skip_special_tokens=False))
        entry = {
            "token": text,
            "logprob": logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [],
        }
        content.append(entry)
    return {"content": content}


def completion_body(
    *,
    completion_id: str,
    model: str,
    message: Mapping[str, Any],
    action: AssistantAction,
    gen: Generation,
    prompt_tokens: int,
    tokenizer: Any,
    logprobs: bool,
    prompt_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` for one call: the assistant ``message`` (its tool calls
    parsed by the model's parser), finish reason, usage and, if asked, logprobs. With
    ``prompt_ids`` (vLLM's ``return_token_ids``) the choice carries ``token_ids`` and the
    body ``prompt_token_ids``: exactly what the engine received and produced."""
    if action.tool_calls:
        finish = "tool_calls"
    else:
        finish = "length" if gen.finish_reason == "length" else "stop"
    out_message: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("tool_calls"):
        out_message["tool_calls"] = list(message["tool_calls"])
    if message.get("reasoning_content") is not None:
        out_message["reasoning_content"] = message["reasoning_content"]
    choice = {
        "index": 0,
        "message": out_message,
        "finish_reason": finish,
        "logprobs": _logprobs(tokenizer, gen) if logprobs else None,
    }
    if prompt_ids is not None:
        choice["token_ids"] = list(gen.token_ids)
    n = len(gen.token_ids)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "total_tokens": prompt_tokens + n,
    }
    body = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return body


def stream_chunks(body: Mapping[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A completion as ``chat.completion.chunk``s: the message in one delta (tool calls
    with their ``index``), then the finish reason, then usage if asked."""
    choice = body["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    if message.get("reasoning_content") is not None:
        delta["reasoning_content"] = message["reasoning_content"]
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    first = {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
    chunks = [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks
