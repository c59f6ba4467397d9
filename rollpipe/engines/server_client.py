"""ServerClient: the HTTP calls a ``ServerEngine`` makes to its vLLM server (aiohttp).

Connections are kept alive and reused, but only while idle under ``KEEPALIVE_S``: vLLM's
server drops a connection idle for 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and a request
sent on one as it closes fails with "Server disconnected". Because a busy process can
notice that close late, a request whose connection the server closed before any answer
is sent once more on a new connection (a generate request under a new ``request_id``;
vLLM aborts a request whose client left, so nothing runs twice to completion). Only a
second failure, or a refused or timed-out connect, means the server is gone: then
``on_unreachable`` is told (the engine dies) and ``EngineError`` is raised.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from rollpipe.engines.records import EngineError

__all__ = ["KEEPALIVE_S", "ServerClient"]

KEEPALIVE_S = 2.0


class ServerClient:
    """HTTP to ``url``; every coroutine runs on the engine's loop."""

    def __init__(
        self,
        url: str,
        connect_timeout_s: float,
        on_unreachable: Callable[[EngineError], None],
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        import aiohttp

        self.url, self.connect_timeout_s, self.on_unreachable = (
            url,
            connect_timeout_s,
            on_unreachable,
        )
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s)
        self.session = aiohttp.ClientSession(connector=connector)
        self.fresh: Any = None  # a session that never reuses a connection, for resends
        self.resent = 0  # requests sent again after the server closed their connection

    async def request(
        self, method: str, path: str, timeout: float | None = None, **kwargs: Any
    ) -> tuple[int, Any]:
        """(status, JSON body or text). ``timeout``: for the whole call (None: a generation
        may take as long as it takes)."""
        import aiohttp

        try:
            return await self._send(self.session, method, path, timeout, **kwargs)
        except aiohttp.ServerDisconnectedError:
            pass  # closed before answering: most likely a kept-alive connection going stale
        except aiohttp.ClientError as e:  # refused, reset, connect timed out
            raise self._unreachable(method, path, e) from e
        self.resent += 1
        if self.fresh is None:
            self.fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        body = kwargs.get("json")
        if isinstance(body, dict) and "request_id" in body:
            kwargs["json"] = body | {"request_id": f"{body['request_id']}-resent"}
        try:
            return await self._send(self.fresh, method, path, timeout, **kwargs)
        except aiohttp.ClientError as e:
            raise self._unreachable(method, path, e) from e

    async def _send(
        self, session: Any, method: str, path: str, timeout: float | None, **kwargs: Any
    ) -> tuple[int, Any]:
        import aiohttp

        limits = aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout_s)
        try:
            async with session.request(method, self.url + path, timeout=limits, **kwargs) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError as e:
            raise EngineError(f"{method} {self.url}{path} got no answer in {timeout} s") from e
        with contextlib.suppress(ValueError):
            return status, json.loads(raw)
        return status, raw.decode(errors="replace")

    def _unreachable(self, method: str, path: str, error: BaseException) -> EngineError:
        dead = EngineError(
            f"vLLM server at {self.url} is unreachable ({method} {path}: {error!r}); "
            "is it running? Create a new ServerEngine once it is back"
        )
        self.on_unreachable(dead)
        return dead

    async def close(self) -> None:
        await self.session.close()
        if self.fresh is not None:
            await self.fresh.close()
