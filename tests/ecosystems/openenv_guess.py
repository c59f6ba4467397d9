"""A guess-the-number game written as an OpenEnv env, served by OpenEnv's own server.

What an OpenEnv user writes: an ``Environment`` with pydantic ``Action`` / ``Observation``
types and ``app = create_app(...)``. The tests serve it with ``OpenEnvEnv(app=
"openenv_guess:app")``. The observation declares ``action_valid`` and ``success`` as
fields (OpenEnv does not send ``metadata`` to clients), which the adapter reports.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH, MAX_TURNS = 1, 32, 6


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""
    action_valid: bool = True
    success: bool = False


class GuessEnvironment(Environment):
    """Guess a number in [LOW, HIGH]; the env says higher or lower. Reward 1 on a hit."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self.target = LOW

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: Any):
        self._state = State(episode_id=episode_id, step_count=0)
        self.target = random.Random(seed).randint(LOW, HIGH)
        text = f"Guess my number between {LOW} and {HIGH}. Answer like <guess>7</guess>."
        return GuessObservation(text=text)

    def step(self, action: GuessAction, timeout_s: float | None = None, **_: Any):
        self._state.step_count += 1
        found = re.findall(r"<guess>\s*(\d+)\s*</guess>", action.message)
        out_of_turns = self._state.step_count >= MAX_TURNS
        if not found:
            text = "Answer like <guess>7</guess>."
            return GuessObservation(text=text, action_valid=False, done=out_of_turns, reward=0.0)
        guess = int(found[-1])
        if guess == self.target:
            return GuessObservation(text="Correct!", success=True, done=True, reward=1.0)
        text = "Higher." if guess < self.target else "Lower."
        return GuessObservation(text=text, done=out_of_turns, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=64)
one_session_app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=1)
"""The same game served for one client at a time (OpenEnv's default)."""
