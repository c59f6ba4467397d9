"""Shared doors: one front door per engine and chat format, for all the AgentEnvs of a
pipeline.

An EpisodeRunner builds one ``AgentEnv`` instance per episode in flight; they share one
:class:`~rollpipe.frontdoor.server.FrontDoor` (one port, one set of sessions) instead of
starting a server each. The door starts with its first user and closes with its last.
"""

from __future__ import annotations

import asyncio
import threading

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.engines.protocol import Engine
from rollpipe.frontdoor.server import FrontDoor

__all__ = ["acquire_door", "release_door"]

_Key = tuple[int, int, EpisodeSettings]
_LOCK = threading.Lock()
_DOORS: dict[_Key, tuple[FrontDoor, set[int], asyncio.Lock]] = {}


async def acquire_door(
    user: object, engine: Engine, chat: ChatFormat, settings: EpisodeSettings
) -> FrontDoor:
    """The started door of ``engine`` / ``chat`` / ``settings``, now used by ``user``
    (on the engine's loop)."""
    key = (id(engine), id(chat), settings)
    with _LOCK:
        entry = _DOORS.get(key)
        if entry is None or entry[0].closed:
            entry = _DOORS[key] = (FrontDoor(engine, chat, settings), set(), asyncio.Lock())
        door, users, starting = entry
        users.add(id(user))
    async with starting:  # episodes starting together start it once
        await door.start()
    return door


def release_door(user: object, door: FrontDoor) -> None:
    """``user`` is done with ``door``; the last user closes it (from any thread)."""
    with _LOCK:
        found = [(k, e) for k, e in _DOORS.items() if e[0] is door]
        last = True
        for key, (_, users, _) in found:
            users.discard(id(user))
            last = not users
            if last:
                del _DOORS[key]
    if last:
        door.close()
