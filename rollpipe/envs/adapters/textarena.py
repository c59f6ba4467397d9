"""TextArena single-player games as rollpipe text envs: ``TextArenaEnv(env_id=...)``.

TextArena's ``step(action)`` returns ``(done, info)``; the player's reward arrives from
``close()`` once the game is over; and its default wrappers re-send the whole history as
each observation. rollpipe keeps the conversation itself, so the adapter plays the *raw*
game (the id's entry point and settings, none of its wrappers) and maps:

* observation: only what is new for the player since its last turn (the game's prompt on
  reset; then its messages, boards and invalid-move notices), one message a line; the
  echo of the player's own action (TextArena's ``PLAYER_ACTION`` message, whichever
  sender the game logs it with) is left out: the model's turn already holds it;
* action: the raw response; with ``format_actions=True`` (TextArena's default
  ``ActionFormattingWrapper``) a response with no ``[`` or ``]`` is sent as ``[response]``;
* reward: 0 until the game ends, then the player's reward from the game (``close()``);
* done: ``terminated`` when the game says done (turn limits are the game's own);
* ``info["action_valid"]``: the game accepted the move (TextArena records invalid
  moves); ``info["success"]``: the game ended with reward 1 (a win); ``info["reason"]``:
  the game's closing reason; metrics ``action_is_valid`` (mean) and ``success`` (last).

Each env draws from a private copy of the global ``random`` state (TextArena seeds and
draws from the global one), so concurrent episodes stay reproducible.

Example:
    >>> from rollpipe.envs import make
    >>> env = make("rollpipe.envs.adapters.textarena:TextArenaEnv", env_id="GuessTheNumber-v0")
    >>> obs, _ = env.reset(seed=0)
    >>> obs.startswith("You are Player 0. You are playing Guess The Number.")
    True
"""

from __future__ import annotations

import difflib
from typing import Any

from rollpipe.envs.adapters._global_random import PrivateRandom
from rollpipe.envs.base import EnvStateError, Info, StepResult, check_seed

WIN_REWARD = 1.0
"""The reward TextArena's single-player games give a won game."""


def _import_textarena() -> Any:
    try:
        import textarena
    except ImportError as exc:
        raise ImportError(
            "TextArenaEnv needs TextArena: pip install 'rollpipe[textarena]'"
        ) from exc
    return textarena


def textarena_env_ids() -> list[str]:
    """Every env id TextArena registers (single- and multi-player; wrapper variants)."""
    _import_textarena()
    from textarena.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


class TextArenaEnv:
    """A single-player TextArena game by id, e.g. ``TextArenaEnv(env_id="Sudoku-v0")``.

    ``env_id``: a TextArena id (:func:`textarena_env_ids`; a ``-train`` / ``-raw`` variant
    plays the same game). ``format_actions``: wrap a bracket-less response in ``[...]``.
    ``**game_kwargs``: override the id's settings (e.g. ``max_turns=8``). A game for
    more than one player fails here, naming the id.
    """

    def __init__(self, env_id: str, *, format_actions: bool = True, **game_kwargs: Any) -> None:
        ta = _import_textarena()
        ids = textarena_env_ids()
        if env_id not in ids:
            close = difflib.get_close_matches(str(env_id), ids, n=5, cutoff=0.5)
            raise ValueError(
                f"TextArenaEnv: env_id={env_id!r} is not a TextArena env; close ids: {close}; "
                f"all {len(ids)}: rollpipe.envs.adapters.textarena.textarena_env_ids()"
            )
        self.env_id, self.format_actions = env_id, bool(format_actions)
        self._ta = ta
        self._random = PrivateRandom()
        spec = ta.envs.registration.ENV_REGISTRY[env_id]
        with self._random.active():
            self.game = ta.envs.registration.make(env_id, **game_kwargs)
            while isinstance(self.game, ta.Wrapper):  # the raw game: rollpipe keeps history
                self.game = self.game.env
            try:  # one game now, so a multi-player id fails when the config is built
                self.game.reset(num_players=1, seed=0)
            except (AssertionError, ValueError) as exc:  # how games refuse 1 player
                raise ValueError(
                    f"TextArenaEnv: env_id={env_id!r} ({spec.entry_point}) does not start "
                    f"as a single-player game ({type(exc).__name__}: {exc}); the adapter "
                    "plays single-player games only"
                ) from exc
        self._done: bool | None = None  # None: before the first reset

    def reset(self, seed: int) -> tuple[str, Info]:
        """Start the game ``seed`` picks; the observation is the game's prompt."""
        seed = check_seed(seed)
        with self._random.active():
            self.game.reset(num_players=1, seed=seed)
            obs = self._new_messages()
        self._done = False
        return obs, {"action_valid": True, "action": None, "success": False}

    def step(self, action_text: str) -> StepResult:
        """Play the response as the player's move; the reward comes when the game ends."""
        if self._done is None or self._done:
            when = "before reset(seed)" if self._done is None else "after the game ended"
            raise EnvStateError(f"TextArenaEnv({self.env_id!r}).step() called {when}")
        action = action_text
        if self.format_actions and "[" not in action and "]" not in action:
            action = f"[{action}]"
        with self._random.active():
            done, step_info = self.game.step(action)
            state = self.game.state
            invalid = getattr(state, "error_count", 0) or state.game_info[0].get("invalid_move")
            valid = not invalid
            obs = self._new_messages()
            reward, reason = 0.0, None
            if done:
                rewards, game_info = self.game.close()
                reward = float((rewards or {}).get(0, 0.0))
                reason = game_info[0].get("reason")
        self._done = bool(done)
        success = self._done and reward >= WIN_REWARD
        if reason:
            obs = f"{obs}\n{reason}" if obs else str(reason)
        info = {
            **(step_info or {}),
            "action_valid": valid,
            "action": action,
            "success": success,
            "format_penalty_applied": False,
            "reason": reason,
            "metrics": {"action_is_valid": valid, "success": success},
            "metrics_agg_mode": {"action_is_valid": "mean", "success": "last"},
        }
        return obs, reward, self._done, False, info

    def _new_messages(self) -> str:
        """What the player has not seen yet, without the echo of its own moves."""
        _, messages = self.game.get_observation()
        echo = self._ta.ObservationType.PLAYER_ACTION
        return "\n".join(str(m[1]) for m in messages if not _is_echo(m, echo))

    def close(self) -> None:
        """Nothing to release (TextArena's ``close`` only reports the result)."""


def _is_echo(message: tuple[Any, ...], echo: Any) -> bool:
    """Whether a TextArena message ``(sender, text, kind)`` logs the player's own move.

    In a one-player game every ``PLAYER_ACTION`` message is the player's move, whoever
    the game names as its sender: most games say player 0, some (``TowerOfHanoi``,
    ``Wordle``) leave the default game sender (-1), and a few (``Countdown``,
    ``Cryptarithm``, ``Slitherlink``) pass the arguments positionally in the wrong order,
    so the kind lands in the sender's place (``(PLAYER_ACTION, 0, action)``).
    """
    return any(part is echo for part in message)
