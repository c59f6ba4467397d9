"""Answers: a prepared call, generated, recorded by its session and written to the client.

The front door hands each call its session prepared (:class:`~rollpipe.frontdoor.session.Call`)
to one answer: :class:`WholeAnswer`, one ``chat.completion`` body, or for ``stream=true``
:class:`~rollpipe.frontdoor.streaming.StreamedAnswer`, server-sent events while it
generates. Either way the session generates the answer (cut at the request's ``stop``
strings) and records it once it is whole; an engine that fails (an error, the time limit)
is the session's failure (its trajectory ends errored) and the call's 500.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.generation_timeout import GenerationTimeoutError
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import EngineError
from rollpipe.frontdoor.requests import RequestError
from rollpipe.frontdoor.responses import completion_body
from rollpipe.frontdoor.session import AgentSession, Call

__all__ = ["Door", "WholeAnswer", "completion_id", "engine_failed"]


def engine_failed(session: AgentSession, exc: BaseException) -> RequestError:
    """The session's failure (its trajectory ends errored) and the 500 the call gets."""
    session.failure = exc
    return RequestError(f"the engine did not answer: {exc!r}", None, 500, "server_error")


def completion_id(session: AgentSession) -> str:
    """The ``id`` of a call's answer: its episode and the session's calls so far."""
    return f"chatcmpl-{session.spec.episode_id}-{session.calls}"


class Door(Protocol):
    """What an answer uses of its front door (``FrontDoor``)."""

    engine: Engine
    chat: ChatFormat
    settings: EpisodeSettings  # the engine request's limits
    model_name: str  # the name the answer gives its model


class WholeAnswer:
    """An unstreamed call of ``session`` through ``door``: the answer in one
    ``chat.completion`` body."""

    def __init__(self, door: Door, session: AgentSession, call: Call) -> None:
        self.door = door
        self.session = session
        self.call = call

    async def send(self) -> web.Response:
        """Generate and record the call; its ``chat.completion``. ``RequestError`` (500)
        when the engine fails."""
        door, session, call = self.door, self.session, self.call
        try:
            gen, text = await session.generate(door.engine, door.settings, call)
        except (GenerationTimeoutError, EngineError) as exc:
            raise engine_failed(session, exc) from exc
        action, message = session.record(call, gen, text)
        request, prompt = call.request, call.prompt
        body = completion_body(
            completion_id=completion_id(session),  # counts this call (a stream's does not)
            model=door.model_name,
            message=message,
            action=action,
            gen=gen,
            prompt_tokens=len(prompt.ids),
            tokenizer=door.chat.tokenizer,
            logprobs=request.logprobs,
            prompt_ids=list(prompt.ids) if request.return_token_ids else None,
        )
        return web.json_response(body)
