"""StreamedAnswer: one ``stream=true`` call, sent as server-sent events while it generates.

The engine hands each piece of the answer's ids to ``on_tokens`` on its own loop; they
cross to the front door's loop through ``Runtime.call_soon`` (the one bridge) into a
queue, and :class:`~rollpipe.frontdoor.chunks.ChunkStream` turns them into chunks. An
abort continues the answer from those ids (``generate_turn`` with ``on_tokens``). The
call is recorded once the answer is whole, with the message the chunks add up to. A
failure after the first event (engine error, time limit, a re-sent request) ends the
stream with an OpenAI ``error`` event, which the ``openai`` client raises. A client that
goes away mid-stream (a harness that gave up, a closed ``openai`` client) is normal for
an agent: a generation still running is aborted (a call is recorded only once its answer
is whole), and one DEBUG line says so (aiohttp would log a traceback for the failed write).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.generation_timeout import GenerationTimeoutError
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.frontdoor.chunks import ChunkStream, StreamBroken
from rollpipe.frontdoor.requests import ChatRequest, RequestError
from rollpipe.frontdoor.responses import logprobs_body
from rollpipe.frontdoor.session import AgentSession, Prompt
from rollpipe.frontdoor.stops import cut_at_stop

__all__ = ["ClientGone", "StreamedAnswer", "engine_failed"]

_log = logging.getLogger(__name__)


class ClientGone(ConnectionError):
    """The client closed the connection before the streamed answer was sent."""


def engine_failed(session: AgentSession, exc: BaseException) -> RequestError:
    """The session's failure (its trajectory ends errored) and the 500 the call gets."""
    session.failure = exc
    return RequestError(f"the engine did not answer: {exc!r}", None, 500, "server_error")


async def _write(response: web.StreamResponse, data: bytes | None) -> None:
    """Write ``data`` (None: the end of the stream); ``ClientGone`` if the client left."""
    try:
        await (response.write_eof() if data is None else response.write(data))
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError, a reset socket
        raise ClientGone(f"the client went away: {exc}") from exc


async def _send(response: web.StreamResponse, chunks: list[dict[str, Any]]) -> None:
    if chunks:  # one write for all of them
        await _write(response, b"".join(b"data: %s\n\n" % json.dumps(c).encode() for c in chunks))


def _drained(queue: asyncio.Queue[list[int] | None], ids: list[int]) -> tuple[list[int], bool]:
    """``ids`` and every piece already waiting behind them (one chunk for all when the
    client reads slower than the engine produces); True once the end was among them."""
    while not queue.empty():
        more = queue.get_nowait()
        if more is None:
            return ids, True
        ids = ids + more
    return ids, False


class StreamedAnswer:
    """One streamed call of ``session`` (see the module doc)."""

    def __init__(
        self,
        engine: Engine,
        chat: ChatFormat,
        settings: EpisodeSettings,
        session: AgentSession,
        request: ChatRequest,
        parser_cls: Any,
    ) -> None:
        self.engine, self.chat, self.settings = engine, chat, settings
        self.session, self.request, self.parser_cls = session, request, parser_cls

    async def send(
        self,
        http: web.Request,
        head: dict[str, Any],
        prompt: Prompt,
        params: SamplingParams,
        json_calls: bool,
    ) -> web.StreamResponse:
        """Generate with ``params`` from ``prompt``, streaming; the finished response.
        ``json_calls``: a forced call that comes as JSON (``forced.py``)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await self._answer(http, response, head, prompt, params, json_calls)
        except ClientGone as gone:  # a generation still running was aborted (_generate)
            spec = self.session.spec
            _log.debug(
                "FrontDoor: episode %s, call %s: %s", spec.episode_id, self.session.calls, gone
            )
        return response

    async def _answer(
        self,
        http: web.Request,
        response: web.StreamResponse,
        head: dict[str, Any],
        prompt: Prompt,
        params: SamplingParams,
        json_calls: bool,
    ) -> None:
        """``send``'s work: every write raises ``ClientGone`` once the client left."""
        chat, request = self.chat, self.request
        chunks = ChunkStream(
            head | {"created": int(time.time())},
            request,
            chat.decode_for_parsing,
            chat.tokenizer,
            self.parser_cls,
            list(prompt.ids),
            self.session.calls,
        )
        try:
            await response.prepare(http)
        except ConnectionError as exc:
            raise ClientGone(f"the client went away: {exc}") from exc
        await _send(response, [chunks.first()])
        try:
            gen, text, rest = await self._generate(response, chunks, prompt, params)
        except (GenerationTimeoutError, EngineError, StreamBroken) as exc:
            await _send(response, [engine_failed(self.session, exc).body()])
            await _write(response, None)
            return
        shown = None if chunks.whole else chunks.message()
        _, message = self.session.record(
            request,
            prompt,
            gen,
            text,
            shown=shown,
            json_calls=json_calls,
            constrained=params.structured_outputs is not None,
        )
        if chunks.whole:
            rest += chunks.whole_calls(message)
        finish = "tool_calls" if message.get("tool_calls") else gen.finish_reason
        logprobs = logprobs_body(chat.tokenizer, gen) if request.logprobs else None
        ids = list(gen.token_ids) if request.return_token_ids else None
        rest.append(chunks.last(finish, logprobs, ids))
        if request.include_usage:
            n, m = len(prompt.ids), len(gen.token_ids)
            usage = {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}
            rest.append({**chunks.head, "choices": [], "usage": usage})
        await _send(response, rest)
        await _write(response, b"data: [DONE]\n\n")
        await _write(response, None)

    async def _generate(
        self,
        response: web.StreamResponse,
        chunks: ChunkStream,
        prompt: Prompt,
        params: SamplingParams,
    ) -> tuple[Generation, str, list[dict[str, Any]]]:
        """The answer (cut at a stop string), its text, and the chunks still to send."""
        runtime, arrived = self.engine.runtime, asyncio.Queue[list[int] | None]()
        turn = asyncio.ensure_future(
            self.session.generate(
                self.engine,
                self.settings,
                prompt,
                params,
                on_tokens=lambda ids: runtime.call_soon(arrived.put_nowait, list(ids)),
            )
        )
        turn.add_done_callback(lambda _: runtime.call_soon(arrived.put_nowait, None))
        try:
            ended = False
            while not ended and (ids := await arrived.get()) is not None:
                ids, ended = _drained(arrived, ids)
                await _send(response, chunks.feed(ids))
            gen = turn.result()
        finally:
            turn.cancel()  # the client went away, or the session ended: abort it
            if turn.done() and not turn.cancelled():
                turn.exception()  # retrieved: a failure after the client left is not logged
        decode = self.chat.decode_for_parsing
        gen, cut = cut_at_stop(gen, self.request.stop, decode)
        text = decode(list(gen.token_ids)) if cut is None else cut
        return gen, text, chunks.finish(list(gen.token_ids), text)
