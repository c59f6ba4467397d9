"""gem (``gem-llm``) environments as rollpipe text envs: ``GemEnv(env_id=...)``.

gem's envs already speak gymnasium-style text: ``reset(seed) -> (obs, info)`` and
``step(text) -> (obs, reward, terminated, truncated, info)``, the action being the
model's raw response (gem parses ``\\boxed{...}`` itself). The adapter adds what rollpipe
expects and gem leaves out:

* the observation is gem's ``prefix + observation + suffix``, as gem's own observation
  wrapper builds it, but without the history it would prepend: rollpipe keeps the
  conversation itself;
* ``info["success"]``: the step ended the episode solved: a game's own solved message
  (every gem game announces a solve with "Congratulations!", whatever it pays: Sudoku,
  Minesweeper and Crosswords pay a share per cell, Hangman and 2048 partial rewards) or
  gem's success reward (1.0, what a single-answer env — ``rg:``, ``math:``, ``qa:``,
  ``code:`` — pays a right answer);
* ``info["metrics"]``: ``success`` (last), ROLL's name, so ``env/{tag}/success`` is logged;
* each env draws from a private copy of the global ``random`` state (gem seeds and
  draws from the global one), so concurrent episodes stay reproducible.

gem does not say whether an action was valid (an unparsable guess gets a format penalty
and ends the game), so ``info`` has no ``action_valid``: the turn counts as unknown.

Example:
    >>> from rollpipe.envs import make
    >>> env = make("rollpipe.envs.adapters.gem:GemEnv", env_id="game:GuessTheNumber-v0-easy")
    >>> obs, info = env.reset(seed=0)
    >>> obs.startswith("You are playing Guess The Number.")
    True
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

from rollpipe.envs.adapters._global_random import PrivateRandom
from rollpipe.envs.base import EnvStateError, Info, StepResult, check_seed

SUCCESS_REWARD = 1.0
"""gem's ``LanguageGameReward.success_reward``: the reward of a solved task."""

SOLVED_MESSAGE = "Congratulations!"
"""How every gem game's observation starts on the step that solves it (gem has no solved
flag; a game's partial rewards do not tell a solve from progress)."""


def _import_gem() -> Any:
    """``gem``, imported without its ``logging.basicConfig(level=INFO)`` taking over the
    root logger of a process that had not configured logging."""
    try:
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        import gem
    except ImportError as exc:
        raise ImportError(
            "GemEnv needs gem: pip install 'rollpipe[gem]' (the gem-llm package)"
        ) from exc
    for handler in root.handlers[len(handlers) :]:
        root.removeHandler(handler)
    root.setLevel(level)
    return gem


def gem_env_ids() -> list[str]:
    """Every env id gem registers (``game:...``, ``rg:...``, ``math:...``, ...)."""
    _import_gem()
    from gem.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


class GemEnv:
    """A gem env by id, e.g. ``GemEnv(env_id="game:GuessTheNumber-v0-easy")``.

    ``env_id``: any id gem registers (see :func:`gem_env_ids`). ``**env_kwargs``: passed
    to ``gem.make`` (they override the id's defaults, e.g. ``max_turns=6``).
    """

    def __init__(self, env_id: str, **env_kwargs: Any) -> None:
        gem = _import_gem()
        ids = gem_env_ids()
        if env_id not in ids:
            close = difflib.get_close_matches(str(env_id), ids, n=5, cutoff=0.5)
            raise ValueError(
                f"GemEnv: env_id={env_id!r} is not a gem env; close ids: {close}. "
                f"gem registers {len(ids)} ids (rollpipe.envs.adapters.gem.gem_env_ids())"
            )
        self.env_id = env_id
        self._random = PrivateRandom()
        with self._random.active():
            self.env = gem.make(env_id, **env_kwargs)
        self._done: bool | None = None  # None: before the first reset

    def reset(self, seed: int) -> tuple[str, Info]:
        """Start the episode ``seed`` picks (gem seeds its generators with it)."""
        seed = check_seed(seed)
        with self._random.active():
            obs, info = self.env.reset(seed=seed)
        self._done = False
        return _text(obs, info), {**info, "action": None, "success": False}

    def step(self, action_text: str) -> StepResult:
        """gem's step on the raw response; reward, terminated and truncated are gem's."""
        if self._done is None or self._done:
            when = "before reset(seed)" if self._done is None else "after the episode ended"
            raise EnvStateError(f"GemEnv({self.env_id!r}).step() called {when}")
        with self._random.active():
            obs, reward, terminated, truncated, info = self.env.step(action_text)
        terminated, truncated = bool(terminated), bool(truncated)
        self._done = terminated or truncated
        success = terminated and (
            str(obs).startswith(SOLVED_MESSAGE) or float(reward) >= SUCCESS_REWARD
        )
        info = {
            **info,
            "action": info.get("parsed_action"),
            "success": success,
            "metrics": {"success": success},
            "metrics_agg_mode": {"success": "last"},
        }
        return _text(obs, info), float(reward), terminated, truncated, info

    def close(self) -> None:
        """Close the gem env (gem's ``close`` where it has one)."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def _text(obs: Any, info: Info) -> str:
    """gem's observation as its observation wrapper shows it, history left out."""
    text = str(obs)
    if text and not text.endswith("\n") and "suffix" in info:
        text += "\n"
    return f"{info.get('prefix', '')}{text}{info.get('suffix', '')}"
