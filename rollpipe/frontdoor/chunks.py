"""ChunkStream: a call's answer as ``chat.completion.chunk`` deltas, as the ids arrive.

The text is split with vLLM's own streaming parser (``vllm.parser``'s ``Parser.parse_delta``,
the one ``vllm serve`` streams with): content, reasoning and tool-call deltas, tool calls
under the ids rollpipe gives them (``call_{turn}_{index}``, as in a whole answer). What
the deltas add up to is the message the session records, so an agent that rebuilds the
message from the stream sends back exactly the conversation the session holds.

Text is held back while it could still be cut: an incomplete UTF-8 character, and the
last ``len(stop) - 1`` characters when the request has ``stop`` strings; once a stop
string appears, nothing more is sent until the answer is cut (``finish``). Logprobs and
token ids come with the last chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rollpipe.agent.parsers import call_id
from rollpipe.engines.records import Generation
from rollpipe.frontdoor.forced import vllm_request
from rollpipe.frontdoor.requests import ChatRequest
from rollpipe.frontdoor.responses import delta_of, logprobs_body

__all__ = ["ChunkStream", "StreamBroken", "parser_class"]


class StreamBroken(RuntimeError):
    """The answer does not extend what was already streamed (the request was re-sent
    from its start, as an engine pool does when a rank leaves)."""


def parser_class(tokenizer: Any, tool_parser: str | None, reasoning_parser: str | None) -> Any:
    """vLLM's composed streaming parser class for these parser names (None: none set)."""
    from vllm.parser.parser_manager import ParserManager

    return ParserManager.get_parser(
        tool_parser_name=tool_parser,
        reasoning_parser_name=reasoning_parser,
        enable_auto_tools=True,
        tokenizer=tokenizer,
    )


class ChunkStream:
    """The deltas of one streamed answer (see the module doc).

    Args:
        head: the chunk fields every chunk repeats (``id``, ``created``, ``model``).
        request: the call; ``decode`` turns ids into text as the session parses it.
        parser_cls: from :func:`parser_class`, or None (then content only).
        prompt_ids: the prompt (the reasoning parser reads whether it ends in reasoning).
        turn: the session's call number (the tool-call ids).
    """

    def __init__(
        self,
        head: dict[str, Any],
        request: ChatRequest,
        decode: Callable[[list[int]], str],
        tokenizer: Any,
        parser_cls: Any,
        prompt_ids: list[int],
        turn: int,
    ) -> None:
        self.head = {**head, "object": "chat.completion.chunk"}
        self.request, self.decode, self.tokenizer, self.turn = request, decode, tokenizer, turn
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.fed = 0  # ids given to the parser so far
        self.text = ""  # text given to the parser so far
        self.hold = max((len(s) for s in request.stop), default=1) - 1
        forced = request.tool_choice in ("required", "function")
        self.vllm_request: Any = None
        self.parser: Any = None
        if parser_cls is not None and request.tool_choice != "none":
            self.vllm_request = vllm_request(request)
            self.parser = parser_cls(tokenizer, self.vllm_request.tools)
        self.whole = forced and self.parser is None  # no streaming parser: calls at the end
        self.content, self.reasoning = "", ""
        self.calls: dict[int, dict[str, Any]] = {}

    def _chunk(
        self, delta: dict[str, Any], finish: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self.head, "choices": [choice | extra]}

    def first(self) -> dict[str, Any]:
        """The opening chunk: the assistant's role, no text yet."""
        return self._chunk({"role": "assistant", "content": ""})

    def feed(self, ids: list[int]) -> list[dict[str, Any]]:
        """Chunks for the text ``ids`` complete (maybe none yet). The parser gets them
        one token at a time, as vLLM's server feeds it: its streaming parsers are built
        for small deltas (a whole tool call in one delta loses its arguments)."""
        chunks: list[dict[str, Any]] = []
        for token in ids:
            self.ids.append(token)
            if self.whole:
                continue
            text = self.decode(self.ids)
            if any(s in text for s in self.request.stop):
                continue  # cut in finish()
            safe = text.rstrip("\ufffd")
            safe = safe[: len(safe) - self.hold] if self.hold else safe
            if len(safe) > len(self.text) and safe.startswith(self.text):
                chunks += self._parsed(safe, finished=False)
        return chunks

    def finish(self, token_ids: list[int], text: str) -> list[dict[str, Any]]:
        """Chunks for the rest of the answer: ``token_ids`` (cut where a stop string
        ends) and their ``text``; ``StreamBroken`` if they do not extend what was sent."""
        if self.ids[: len(token_ids)] != token_ids or not text.startswith(self.text):
            raise StreamBroken(
                "the engine's answer does not continue the tokens already streamed (the "
                "request was sent again from its start); the call failed"
            )
        self.ids = list(token_ids)
        chunks = self._parsed(text, finished=True)
        tools = None if self.parser is None else self.parser.tool_parser
        rest = tools.get_remaining_unstreamed_args() if tools is not None else ""
        if rest and self.calls:  # arguments the parser read but never sent in a delta
            call = {"index": max(self.calls), "function": {"arguments": rest}}
            self._add({"tool_calls": [call]})
            chunks.append(self._chunk({"tool_calls": [call]}))
        return chunks

    def _parsed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        delta_text, new_ids = text[len(self.text) :], self.ids[self.fed :]
        self.text, self.fed = text, len(self.ids)
        if self.parser is None:
            delta = {"content": delta_text} if delta_text else {}
        else:
            message = self.parser.parse_delta(
                delta_text, new_ids, self.vllm_request, self.prompt_ids, finished=finished
            )
            delta = self._named(delta_of(message)) if message is not None else {}
        self._add(delta)
        return [self._chunk(delta)] if delta else []

    def _named(self, delta: dict[str, Any]) -> dict[str, Any]:
        for call in delta.get("tool_calls", ()):
            if call.get("id") is not None:
                call["id"] = call_id(self.turn, call["index"])
        return delta

    def _add(self, delta: dict[str, Any]) -> None:
        self.content += delta.get("content") or ""
        self.reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", ()):
            known = self.calls.setdefault(call["index"], {"name": "", "arguments": ""})
            fn = call.get("function") or {}
            known["id"] = known.get("id") or call.get("id")
            known["name"] += fn.get("name") or ""
            known["arguments"] += fn.get("arguments") or ""

    def closing(self, message: Mapping[str, Any], gen: Generation) -> list[dict[str, Any]]:
        """The chunks that end the answer ``gen`` once its ``message`` is recorded: for a
        forced call with no streaming parser its calls, in one delta (their text was never
        streamed); the last chunk (:meth:`last`); the usage, if the request asked."""
        chunks = []
        calls = [{"index": i, **c} for i, c in enumerate(message.get("tool_calls") or ())]
        if self.whole and calls:
            chunks.append(self._chunk({"tool_calls": calls}))
        finish = "tool_calls" if message.get("tool_calls") else gen.finish_reason
        logprobs = logprobs_body(self.tokenizer, gen) if self.request.logprobs else None
        ids = list(gen.token_ids) if self.request.return_token_ids else None
        chunks.append(self.last(finish, logprobs, ids))
        if self.request.include_usage:
            n, m = len(self.prompt_ids), len(gen.token_ids)
            usage = {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
            chunks.append({**self.head, "choices": [], "usage": usage})
        return chunks

    def message(self) -> dict[str, Any]:
        """The assistant message the deltas sent add up to."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [
                {
                    "id": c.get("id") or call_id(self.turn, i),
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for i, c in sorted(self.calls.items())
            ]
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        return out

    def last(self, finish: str, logprobs: Any, token_ids: list[int] | None) -> dict[str, Any]:
        """The closing chunk: the finish reason, and the logprobs and token ids if asked."""
        extra: dict[str, Any] = {"logprobs": logprobs}
        if token_ids is not None:
            extra["token_ids"] = token_ids
        return self._chunk({}, finish, **extra)
