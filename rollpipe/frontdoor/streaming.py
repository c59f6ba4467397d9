"""StreamedAnswer: one ``stream=true`` call, sent as server-sent events while it generates.

The engine hands each piece of the answer's ids to ``on_tokens`` on its own loop; they
cross to the front door's loop through ``Runtime.call_soon`` (the one bridge) into a
queue, and :class:`~rollpipe.frontdoor.chunks.ChunkStream` turns them into chunks. An
abort continues the answer from those ids (``generate_turn`` with ``on_tokens``). The
call is recorded once the answer is whole, with the message the chunks add up to (the
other kind of answer, one body, is ``answers.py``'s). A
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

from rollpipe.agent.generation_timeout import GenerationTimeoutError
from rollpipe.engines.records import EngineError, Generation
from rollpipe.frontdoor.answers import Door, completion_id, engine_failed
from rollpipe.frontdoor.chunks import ChunkStream, StreamBroken
from rollpipe.frontdoor.session import AgentSession, Call

__all__ = ["ClientGone", "StreamedAnswer"]

_log = logging.getLogger(__name__)


class ClientGone(ConnectionError):
    """The client closed the connection before the streamed answer was sent."""


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
    """One streamed call of ``session`` through ``door`` (see the module doc);
    ``parser_cls`` is vLLM's streaming parser class (``chunks.parser_class``), or None."""

    def __init__(self, door: Door, session: AgentSession, call: Call, parser_cls: Any) -> None:
        self.door = door
        self.session = session
        self.call = call
        self.parser_cls = parser_cls

    async def send(self, http: web.Request) -> web.StreamResponse:
        """Generate the call, streaming its chunks; the finished response."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await self._answer(http, response)
        except ClientGone as gone:  # a generation still running was aborted (_generate)
            spec = self.session.spec
            _log.debug(
                "FrontDoor: episode %s, call %s: %s", spec.episode_id, self.session.calls, gone
            )
        return response

    async def _answer(self, http: web.Request, response: web.StreamResponse) -> None:
        """``send``'s work: every write raises ``ClientGone`` once the client left."""
        chat, session, call = self.door.chat, self.session, self.call
        request, prompt = call.request, call.prompt
        model = self.door.model_name
        head = {"id": completion_id(session), "model": model, "created": int(time.time())}
        chunks = ChunkStream(
            head,
            request,
            chat.decode_for_parsing,
            chat.tokenizer,
            self.parser_cls,
            list(prompt.ids),
            session.calls,
        )
        try:
            await response.prepare(http)
        except ConnectionError as exc:
            raise ClientGone(f"the client went away: {exc}") from exc
        await _send(response, [chunks.first()])
        try:
            gen, text = await self._generate(response, chunks)
            rest = chunks.finish(list(gen.token_ids), text)
        except (GenerationTimeoutError, EngineError, StreamBroken) as exc:
            await _send(response, [engine_failed(session, exc).body()])
            await _write(response, None)
            return
        _, message = session.record(call, gen, text, None if chunks.whole else chunks.message())
        await _send(response, rest + chunks.closing(message, gen))
        await _write(response, b"data: [DONE]\n\n")
        await _write(response, None)

    async def _generate(
        self, response: web.StreamResponse, chunks: ChunkStream
    ) -> tuple[Generation, str]:
        """The answer (cut at a stop string) and its text, its pieces streamed as they
        come."""
        engine, arrived = self.door.engine, asyncio.Queue[list[int] | None]()
        runtime = engine.runtime
        turn = asyncio.ensure_future(
            self.session.generate(
                engine,
                self.door.settings,
                self.call,
                on_tokens=lambda ids: runtime.call_soon(arrived.put_nowait, list(ids)),
            )
        )
        turn.add_done_callback(lambda _: runtime.call_soon(arrived.put_nowait, None))
        try:
            ended = False
            while not ended and (ids := await arrived.get()) is not None:
                ids, ended = _drained(arrived, ids)
                await _send(response, chunks.feed(ids))
            return turn.result()
        finally:
            turn.cancel()  # the client went away, or the session ended: abort it
            if turn.done() and not turn.cancelled():
                turn.exception()  # retrieved: a failure after the client left is not logged
