"""The JSON the front door answers with: OpenAI's ``chat.completion``, the pieces of its
streamed chunks, and the model list."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rollpipe.agent.actions import AssistantAction
from rollpipe.engines.records import Generation

__all__ = ["completion_body", "delta_of", "logprobs_body", "models_body"]


def models_body(name: str) -> dict[str, Any]:
    """``/v1/models``: the one model this server generates with."""
    model = {"id": name, "object": "model", "created": 0, "owned_by": "rollpipe"}
    return {"object": "list", "data": [model]}


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = str(tokenizer.decode([token_id], skip_special_tokens=False))
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def logprobs_body(tokenizer: Any, gen: Generation) -> dict[str, Any]:
    """OpenAI's ``logprobs.content``: each sampled token, with its ``top_logprobs`` when
    the request asked for them."""
    tops = gen.top_logprobs or ((),) * len(gen.token_ids)
    content = []
    for token_id, logprob, top in zip(gen.token_ids, gen.logprobs, tops, strict=False):
        entry = _entry(tokenizer, token_id, logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in top]
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
        "logprobs": logprobs_body(tokenizer, gen) if logprobs else None,
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


def delta_of(message: Any) -> dict[str, Any]:
    """vLLM's streaming ``DeltaMessage`` as an OpenAI chunk ``delta`` (its ``reasoning``
    as ``reasoning_content``, as in a whole answer; empty fields left out)."""
    delta: dict[str, Any] = {}
    if message.content:
        delta["content"] = message.content
    if message.reasoning:
        delta["reasoning_content"] = message.reasoning
    if message.tool_calls:
        delta["tool_calls"] = [c.model_dump(exclude_none=True) for c in message.tool_calls]
    return delta
