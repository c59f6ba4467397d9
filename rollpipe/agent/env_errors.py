"""How an env failure is told: the errored trajectory's text, the text of an exception
re-raised under ``raise_env_errors=True``, the entry in ``meta_info["env_errors"]``, and
the WARNING logged for the first failure of each env tag and exception type.

Each says what was raised (type and text, cut to ``MAX_ERROR_CHARS``) and where: env
class and call, env name, seed, episode and turn, e.g.::

    EnvReturnError('FrozenLake.step: reward is nan; a reward must be a finite number') (in
    FrozenLake.step: env 'frozenlake', seed 5, episode 3, turn 0, env_timeout_s=60.0)
"""

from __future__ import annotations

import logging
from typing import Any

from rollpipe.agent.env_threads import EnvTimeoutError
from rollpipe.agent.generation_timeout import GenerationTimeoutError
from rollpipe.agent.records import Trajectory

__all__ = ["MAX_ERROR_CHARS", "EnvFailed", "FirstErrors", "error_entry"]

_log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 500
"""How much of an env exception's text an errored trajectory keeps (``where`` comes whole)."""


def _cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else f"{text[: limit - 25]}... ({len(text)} chars)"


class EnvFailed(Exception):
    """An exception raised by the env (``error``) with where it happened; also a request
    over ``generation_timeout_s``, which fails its episode the same way.

    ``where`` starts with the call (``"FrozenLake.step: env 'frozenlake', seed 5, ..."``,
    or ``"engine request: env ..."``); ``call`` is that part, ``str(self)`` the text the
    trajectory keeps, ``note`` what a re-raised ``error`` carries.
    """

    def __init__(self, error: Exception, where: str) -> None:
        if isinstance(error, EnvTimeoutError):
            hint = "raise env_timeout_s or fix the env"
            text = f"EnvTimeoutError({where}: {_cut(str(error))}; {hint})"
        elif isinstance(error, GenerationTimeoutError):
            hint = "raise generation_timeout_s"
            text = f"GenerationTimeoutError({where}: {_cut(str(error))}; {hint})"
        else:
            hint = ""
            text = f"{_cut(repr(error))} (in {where})"
        super().__init__(text)
        self.error = error
        self.call = where.partition(":")[0]
        self.located = f"(in {where}" + (f"; {hint})" if hint else ")")
        self.note = f"rollpipe: raised in {where}" + (f"; {hint}" if hint else "")

    def reraise(self) -> None:
        """Raise the env's own exception (its type kept, so ``except EnvTimeoutError``
        still catches it) with where it was raised appended to its text, so ``str(exc)``
        says it; an exception whose text does not come from its ``args`` (a custom
        ``__str__``, ``OSError(errno, ...)``) gets ``note`` instead, which the traceback
        prints."""
        error = self.error
        told = self.located in str(error) or self.note in getattr(error, "__notes__", ())
        if not told and not _append(error, self.located):  # (told: the same object twice)
            error.add_note(self.note)
        raise error from None


def _append(error: BaseException, located: str) -> bool:
    """Append ``located`` to the text ``error`` carries in ``args``; whether ``str(error)``
    now shows it (else ``args`` are put back)."""
    args = error.args
    if len(args) > 1:
        return False
    error.args = (f"{args[0]} {located}" if args and str(args[0]) else located,)
    try:
        shown = located in str(error)
    except Exception:  # a __str__ that fails on the new args
        shown = False
    if not shown:
        error.args = args
    return shown


class FirstErrors:
    """Logs the first errored trajectory of each (env tag, exception type) at WARNING,
    as it happens: later ones of the same pair are only counted
    (``dropped/errored_trajectories``), so a broken env speaks at once without a line per
    episode."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def saw(self, traj: Trajectory) -> bool:
        """Log ``traj``'s error if it is the first of its pair; whether it was logged."""
        key = (traj.tag, traj.error_type or "")
        if traj.end_reason != "error" or key in self._seen:
            return False
        self._seen.add(key)
        _log.warning(
            "first %s from env tag %r: %s. The episode is dropped (its group replaced "
            "unless redundancy covers it); later %ss of this tag are only counted "
            "(dropped/errored_trajectories); raise_env_errors=True raises the first instead",
            key[1] or "error",
            traj.tag,
            traj.error,
            key[1] or "error",
        )
        return True


def error_entry(traj: Trajectory) -> dict[str, Any]:
    """What a user reads about an errored trajectory (``meta_info["env_errors"]``): ``env``,
    ``tag``, ``seed``, ``group_id``, ``episode_id``, ``turn``, ``call`` (e.g.
    ``"FrozenLake.step"``), ``type`` (the exception's class name) and ``message``
    (``Trajectory.error``: the exception's repr, then where)."""
    return {
        "env": traj.spec.env_name,
        "tag": traj.tag,
        "seed": traj.spec.seed,
        "group_id": traj.group_id,
        "episode_id": traj.spec.episode_id,
        "turn": max(len(traj.turns) - 1, 0),  # the turn it failed in (0: reset, or turn 0)
        "call": traj.error_call or "",
        "type": traj.error_type or "",
        "message": traj.error or "",
    }
