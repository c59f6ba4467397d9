"""ServerClient when the server closes a connection before answering.

vLLM's server cannot be made to drop one chosen connection on cue, so the peer here is a
raw TCP listener that closes the first ``drops`` connections as soon as a request
arrives (what a kept-alive connection closing under a reused request looks like to the
client) and answers the rest. The vLLM server itself is covered in
tests/distributed/test_engine_server.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rollpipe.engines.records import EngineError
from rollpipe.engines.server_client import ServerClient

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def _serve(drops: int, bodies: list[Any]) -> asyncio.Server:
    """Closes the first ``drops`` requests' connections unanswered; answers the rest {}."""
    seen = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        head = await reader.readuntil(b"\r\n\r\n")
        length = [
            int(x.split(b":")[1])
            for x in head.split(b"\r\n")
            if x.lower().startswith(b"content-length")
        ]
        bodies.append(json.loads(await reader.readexactly(length[0])) if length else None)
        seen += 1
        if seen > drops:
            writer.write(OK)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _talk(drops: int) -> tuple[list[Any], list[EngineError], Any, int]:
    bodies: list[Any] = []
    deaths: list[EngineError] = []

    async def main() -> tuple[Any, int]:
        server = await _serve(drops, bodies)
        port = server.sockets[0].getsockname()[1]
        client = ServerClient(f"http://127.0.0.1:{port}", 5.0, deaths.append)
        try:
            answer = await client.request("POST", "/generate", json={"request_id": "r-1"})
            return answer, client.resent
        except EngineError as e:
            return e, client.resent
        finally:
            await client.close()
            server.close()

    answer, resent = asyncio.run(main())
    return bodies, deaths, answer, resent


def test_a_request_dropped_once_is_resent_under_a_new_id() -> None:
    bodies, deaths, answer, resent = _talk(drops=1)
    assert answer == (200, {}) and resent == 1 and not deaths
    assert bodies == [{"request_id": "r-1"}, {"request_id": "r-1-resent"}]


def test_a_request_dropped_twice_means_the_server_is_gone() -> None:
    bodies, deaths, answer, resent = _talk(drops=2)
    assert isinstance(answer, EngineError) and "is unreachable" in str(answer)
    assert resent == 1 and deaths == [answer] and len(bodies) == 2


def test_an_answered_request_is_sent_once() -> None:
    bodies, deaths, answer, resent = _talk(drops=0)
    assert answer == (200, {}) and resent == 0 and not deaths and len(bodies) == 1
