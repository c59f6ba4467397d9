"""The messages between the driver and an episode worker, both ways, as plain records.

The driver sends :class:`Start` (run this spec), :class:`Cancel` (drop that episode) and
:class:`Answer` (a generation, or the error the engine raised); a worker sends
:class:`Request` (generate this prompt), :class:`Abandon` (that request is no longer
wanted) and :class:`Finished` (the trajectory, or the error that ended the episode).
Each side sends them in batches (one Ray call carries every message ready), so the
cost of a call is shared by every turn in it. ``key`` is the driver's episode number,
``req`` the worker's request number.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs

from rollpipe.agent.records import EpisodeSpec, Trajectory
from rollpipe.engines.records import Generation, SamplingParams

__all__ = ["Abandon", "Answer", "Cancel", "Finished", "Request", "Start"]


@attrs.frozen
class Start:
    """Driver -> worker: run ``spec``'s episode as episode ``key``."""

    key: int
    spec: EpisodeSpec


@attrs.frozen
class Cancel:
    """Driver -> worker: episode ``key`` is no longer wanted (its group was dropped)."""

    key: int


@attrs.frozen
class Answer:
    """Driver -> worker: request ``req``'s generation (or the error that ended it), and
    the rank of the engine pool it ran on (the route's rank, kept by the worker)."""

    req: int
    generation: Generation | None
    error: BaseException | None = None
    rank: int | None = None


@attrs.frozen
class Request:
    """Worker -> driver: one engine request; ``route_key`` / ``route_rank`` are its
    conversation's route (``rollpipe.engines.routing.Route``)."""

    req: int
    prompt: list[int]
    params: SamplingParams
    images: tuple[Any, ...] = ()
    route_key: Hashable | None = None
    route_rank: int | None = None


@attrs.frozen
class Abandon:
    """Worker -> driver: request ``req`` is no longer awaited (its caller was cancelled)."""

    req: int


@attrs.frozen
class Finished:
    """Worker -> driver: episode ``key`` ended with ``trajectory``, or raised ``error``."""

    key: int
    trajectory: Trajectory | None
    error: BaseException | None = None
