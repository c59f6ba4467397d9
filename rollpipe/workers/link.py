"""WorkerLink: the driver's end of one episode worker — its actor and its mail both ways.

Two tasks on the driver's loop carry the mail: one pushes every message waiting in the
outbox in one Ray call (and, while that call is out, gathers the next batch), the other
pulls the worker's messages and hands each batch to ``on_mail``. So one Ray call carries
every turn that is ready, however many episodes the worker runs. When either call says
the actor is gone (``ActorLost``: killed, its node died, its process crashed) the link
ends and ``on_lost`` is told once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from rollpipe._utils.ray_calls import ActorLost, ActorRaised, call_actor

__all__ = ["WorkerLink"]

_LOST = object()  # what a call to a lost actor returns


class WorkerLink:
    """The mail of one worker actor (see the module doc); used on the driver's loop only.

    ``running`` holds the driver's keys of the episodes it runs now.
    """

    def __init__(
        self,
        slot: int,
        actor: Any,
        on_mail: Callable[[WorkerLink, list[Any]], None],
        on_lost: Callable[[WorkerLink, BaseException], None],
    ) -> None:
        self.slot, self.actor = slot, actor
        self.running: set[int] = set()
        self.lost: BaseException | None = None
        self._on_mail, self._on_lost = on_mail, on_lost
        self._outbox: list[Any] = []
        self._mail = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._push_loop()), loop.create_task(self._pull_loop())]

    def send(self, message: Any) -> None:
        """Queue ``message`` for the worker (sent with the next push)."""
        if self.lost is None:
            self._outbox.append(message)
            self._mail.set()

    async def _push_loop(self) -> None:
        while True:
            await self._mail.wait()
            self._mail.clear()
            batch, self._outbox = self._outbox, []
            if await self._call("push", batch) is _LOST:
                return

    async def _pull_loop(self) -> None:
        while True:
            mail = await self._call("pull")
            if mail is _LOST:
                return
            self._on_mail(self, mail)

    async def _call(self, method: str, *args: Any) -> Any:
        """The actor's ``method``; ``_LOST`` once the actor is lost (``on_lost`` told)."""
        try:
            return await call_actor(self.actor, method, *args)
        except (ActorLost, ActorRaised) as error:  # raised: the worker's loop closed
            self._lose(error)
            return _LOST

    def _lose(self, error: BaseException) -> None:
        if self.lost is None:
            self.lost = error
            self._outbox.clear()
            for task in self._tasks:
                if task is not asyncio.current_task():
                    task.cancel()
            self._on_lost(self, error)

    async def stop(self) -> None:
        """Stop carrying mail (the actor is killed by the caller)."""
        self.lost = self.lost or ActorLost("stop", RuntimeError("the link was stopped"))
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._tasks, return_exceptions=True)
