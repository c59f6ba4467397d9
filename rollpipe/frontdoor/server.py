"""FrontDoor: an OpenAI-compatible server whose every call becomes exact training ids.

``/v1/models`` and ``/v1/chat/completions`` (messages, with ``image_url`` parts as
``data:`` URLs on an engine that supports images (``images.py``), ``tools``,
``tool_choice`` auto, none, required or a named function (``forced.py``), sampling
fields, ``stop`` strings, ``n=1``, ``logprobs`` and ``top_logprobs``, ``stream`` token by
token (``streaming.py``)),
served by ``aiohttp.web`` on the engine's own runtime loop: no second event loop, no
thread hop between a request and the engine. Each session has its own key
(``Authorization: Bearer <key>``). A request with a missing, unknown or finished key
gets 401 and touches nothing; a malformed one gets OpenAI-style error JSON (400) naming
the field. Requests are rendered with the model's chat template (never one the client
sends) and recorded by their :class:`~rollpipe.frontdoor.session.AgentSession`;
responses carry the tool calls the model's own parser read. Binds ``127.0.0.1`` unless
told otherwise.

Examples:
    >>> import openai
    >>> with FrontDoor(engine, tokenizer, EpisodeSettings(sampling={"max_tokens": 8})) as door:
    ...     session = door.open_session()  # any client: base_url=door.url, api_key=session.key
    ...     with openai.OpenAI(base_url=door.url, api_key=session.key) as client:
    ...         hi = [{"role": "user", "content": "What is 2 + 3?"}]
    ...         reply = client.chat.completions.create(model="rollpipe", messages=hi)
    ...     trajectory = door.finish(session.key, reward=1.0)
    >>> len(trajectory.turns), trajectory.score, reply.choices[0].message.role
    (1, 1.0, 'assistant')
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.conversation_choice import image_conversation_registered
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.engines.protocol import Engine, engine_supports
from rollpipe.frontdoor.answers import WholeAnswer
from rollpipe.frontdoor.chunks import parser_class
from rollpipe.frontdoor.forced import forced_outputs
from rollpipe.frontdoor.images import image_parts
from rollpipe.frontdoor.requests import ChatRequest, RequestError, parse_chat_request
from rollpipe.frontdoor.responses import models_body
from rollpipe.frontdoor.session import AgentSession
from rollpipe.frontdoor.streaming import StreamedAnswer

__all__ = ["FrontDoor", "SessionTimeoutError"]

LOOPBACK = ("127.0.0.1", "::1", "localhost")
STOP_WAIT_S = 1.0  # how long stop() waits for requests still being answered


class SessionTimeoutError(TimeoutError):
    """A session was still open past its ``timeout_s``."""


def _error(error: RequestError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


_UNSET = object()


class FrontDoor:
    """The OpenAI-compatible front door of ``engine`` (see the module doc).

    Args:
        engine: the engine the calls generate with (its runtime runs the server).
        chat: a :class:`ChatFormat`, or a tokenizer (then built from ``settings``). Its
            ``system_prompt`` is not used: the agent's messages are the conversation.
        settings: :class:`EpisodeSettings`: default sampling (a request's own fields
            win), ``max_length`` (a prompt plus ``max_tokens``), ``tool_parser``,
            ``generation_timeout_s``, ``max_aborts``.
        host / port: where to listen; ``port=0`` picks a free one (see :attr:`url`). A
            host other than loopback needs ``allow_remote=True`` (keys still apply).
        model_name: the id ``/v1/models`` lists (requests may name any model).

    Examples:
        >>> door = FrontDoor(engine, tokenizer); session = door.open_session()  # no ``with``
        >>> url = engine.runtime.call(door.start()); engine.runtime.call(door.stop())
        >>> url.endswith("/v1"), session.finished, door.closed, door.close(), door.closed
        (True, True, False, None, True)
    """

    def __init__(
        self,
        engine: Engine,
        chat: Any,
        settings: EpisodeSettings | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_remote: bool = False,
        model_name: str = "rollpipe",
    ) -> None:
        if host not in LOOPBACK and not allow_remote:
            raise ValueError(
                f"FrontDoor.host={host!r} is not loopback; pass allow_remote=True to serve "
                "other machines (every request still needs its session key)"
            )
        self.engine, self.settings = engine, settings or EpisodeSettings()
        self.chat = chat if isinstance(chat, ChatFormat) else self.settings.chat_format(chat)
        self.host, self.port, self.model_name = host, port, model_name
        self.sessions: dict[str, AgentSession] = {}
        self._expired: dict[str, AgentSession] = {}  # ended by their time limit, not finished
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._scope = engine.runtime.scope("FrontDoor")
        self._parser_cls: Any = _UNSET  # vLLM's streaming parser class, built when first used

    # -- lifecycle (on the loop) ------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the engine's runtime closed).

        >>> door = FrontDoor(engine, tokenizer); door.closed, door.close(), door.closed
        (False, None, True)"""
        return self._scope.closed

    @property
    def url(self) -> str:
        """The OpenAI ``base_url`` (``http://host:port/v1``); set once started.

        >>> with FrontDoor(engine, tokenizer) as door: print(door.url)
        http://127.0.0.1:.../v1"""
        if self._runner is None:
            raise RuntimeError("FrontDoor.url: the server is not started; call start() first")
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> str:
        """Start serving on the running loop (the engine's runtime); the base url.

        >>> d = FrontDoor(engine, tokenizer); print(engine.runtime.call(d.start())); d.close()
        http://127.0.0.1:.../v1"""
        if self._runner is None:
            app = web.Application(client_max_size=64 * 2**20)
            app.add_routes(
                [
                    web.get("/v1/models", self._models),
                    web.post("/v1/chat/completions", self._chat),
                ]
            )
            runner = web.AppRunner(
                app, handle_signals=False, access_log=None, shutdown_timeout=STOP_WAIT_S
            )
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = runner.addresses[0][1]
            self._runner = runner
        return self.url

    async def stop(self) -> None:
        """Stop serving; open sessions are finished (their requests cancelled).

        >>> with FrontDoor(engine, tokenizer) as d: engine.runtime.call(d.stop()); d.url
        Traceback (most recent call last):
        RuntimeError: FrontDoor.url: the server is not started; call start() first"""
        for key in list(self.sessions):
            self._end(key)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def close(self) -> None:
        """Stop serving (waiting at most ``STOP_WAIT_S`` off the loop); idempotent, from
        any thread. On the loop's own thread the stop is scheduled, not awaited.

        >>> door = FrontDoor(engine, tokenizer); door.close(); door.close(); door.closed
        True"""
        runtime = self.engine.runtime
        if runtime.alive and not self._scope.closed:
            if runtime.in_loop():
                runtime.loop.create_task(self.stop())
            else:
                with contextlib.suppress(Exception):  # a loop that is busy or closing
                    self._scope.submit(self.stop()).result(STOP_WAIT_S + 1.0)
        self._scope.close()

    def __enter__(self) -> FrontDoor:
        self._scope.call(self.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sessions ---------------------------------------------------------------------
    def open_session(
        self,
        spec: EpisodeSpec | None = None,
        admit: Callable[[], Awaitable[None]] | None = None,
        *,
        timeout_s: float | None = None,
        keep_tools: bool = True,
    ) -> AgentSession:
        """A new session with a fresh key (``spec`` names the episode in its rows).

        ``timeout_s``: a session still open that long later ends (its key gets 401, its
        requests in flight are cancelled) and :meth:`finish` gives an errored trajectory.
        ``keep_tools``: a call without ``tools`` is rendered with the session's last
        tools, so it continues the row (:class:`AgentSession`).

        >>> with FrontDoor(engine, tokenizer) as door: door.open_session().key in door.sessions
        True
        """
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"open_session: timeout_s must be > 0 or None, got {timeout_s!r}")
        if spec is None:
            n = next(self._ids)
            spec = EpisodeSpec(n, n, n, "agent")
        key = "rp-" + secrets.token_urlsafe(24)
        images = engine_supports(self.engine, "images") and image_conversation_registered()
        session = AgentSession(
            key,
            spec,
            self.chat,
            admit,
            keep_tools=keep_tools,
            sampling=self.settings.sampling,
            images=images,
        )
        self.sessions[key] = session
        if timeout_s is not None:
            self.engine.runtime.call_soon(self._expire_after, key, timeout_s)
        return session

    def _expire_after(self, key: str, timeout_s: float) -> None:
        self.engine.runtime.loop.call_later(timeout_s, self._expire, key, timeout_s)

    def _expire(self, key: str, timeout_s: float) -> None:
        if key in self.sessions:
            session = self._end(key)
            limit = SessionTimeoutError(f"the session was open past its limit of {timeout_s} s")
            session.failure = session.failure or limit
            self._expired[key] = session

    def _end(self, key: str) -> AgentSession:
        session = self.sessions.pop(key, None)
        if session is None:
            raise KeyError(f"no open session with key {key[:6]}...; it finished already")
        session.finished = True
        for task in list(session.in_flight):
            self.engine.runtime.call_soon(task.cancel)
        return session

    def finish(self, key: str, reward: float = 0.0, **fields: Any) -> Trajectory:
        """End session ``key`` (its key then gets 401) and return its trajectory;
        ``fields`` go to :meth:`AgentSession.trajectory`.

        >>> with FrontDoor(engine, tokenizer) as d: trajectory = d.finish(d.open_session().key, 1.0)
        >>> trajectory.num_turns, trajectory.score  # the reward goes on the last turn: none here
        (0, 0.0)"""
        session = self._expired.pop(key, None) or self._end(key)
        if session.failure is not None:
            fields.setdefault("error", session.failure)
            fields.setdefault("error_call", "session")
        return session.trajectory(reward, **fields)

    # -- handlers (on the loop) -------------------------------------------------------
    def _session(self, request: web.Request) -> AgentSession:
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        session = self.sessions.get(key.strip()) if scheme.lower() == "bearer" else None
        if session is None or session.finished:
            raise RequestError(
                "unknown or finished session key: send 'Authorization: Bearer <key>' with "
                "the key of an open session",
                None,
                401,
                "authentication_error",
                "invalid_api_key",
            )
        return session

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except RequestError as error:
            return _error(error)
        return web.json_response(models_body(self.model_name))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        """One call: its session (by key), its body parsed, the call prepared by the
        session and answered, whole or streamed; a ``RequestError`` as its error JSON."""
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the body is not valid JSON: {exc}", None) from exc
            parsed = parse_chat_request(body, session.last_request)
            session.last_request = parsed
            async with session.answering():  # one call of the session at a time
                outputs, json_calls = self._outputs(parsed)
                call = session.prepare(parsed, self.settings.max_length, outputs, json_calls)
                if parsed.stream:
                    streamed = StreamedAnswer(self, session, call, self._parsers())
                    return await streamed.send(request)
                whole = WholeAnswer(self, session, call)
                return await whole.send()
        except RequestError as error:
            return _error(error)

    def _outputs(self, request: ChatRequest) -> tuple[dict[str, Any] | None, bool]:
        """A forced call's grammar and whether its call comes as JSON (``forced.py``);
        ``RequestError`` (400) when the engine cannot do what the request needs."""
        outputs, json_calls = None, False
        if request.tool_choice in ("required", "function"):
            chat = self.chat
            outputs, json_calls = forced_outputs(request, chat.tokenizer, self._parsers())
        self._check_engine(request, outputs)
        return outputs, json_calls

    def _parsers(self) -> Any:
        """vLLM's composed parser class for the door's parsers (None: none set), built
        when first needed."""
        if self._parser_cls is _UNSET:
            chat = self.chat
            self._parser_cls = parser_class(chat.tokenizer, chat.tool_parser, chat.reasoning_parser)
        return self._parser_cls

    def _check_engine(self, request: ChatRequest, outputs: dict[str, Any] | None) -> None:
        """A 400 for what the request needs and the engine cannot do (its ``supports``)."""
        where = image_parts(request.messages)
        if where and not engine_supports(self.engine, "images"):
            raise RequestError(
                f"{where[0]} is an image: this server's engine ({type(self.engine).__name__}) "
                "does not support images (supports('images') is False); serve a "
                "vision-language model on a VLLMEngine or HFEngine, or send text only",
                where[0],
            )
        needs = []
        if request.sampling.get("top_logprobs"):
            needs.append(("top_logprobs", request.sampling["top_logprobs"], "top_logprobs"))
        if outputs is not None:
            choice = request.tool_name or request.tool_choice
            needs.append(("tool_choice", choice, "structured_outputs"))
        for param, value, feature in needs:
            if not engine_supports(self.engine, feature):
                raise RequestError(
                    f"{param}={value!r}: this server's engine ({type(self.engine).__name__}) "
                    f"does not support {feature}; use a vLLM engine, or leave {param} out",
                    param,
                )
