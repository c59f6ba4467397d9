"""Expert play written as the pipeline's own token ids, for supervised warm starts.

An expert episode is played on rollpipe's own envs (FrozenLake: distances to the goal
by breadth-first search; Sokoban: :func:`rollpipe.envs.solve`) and written exactly as
:func:`rollpipe.agent.episode.run_episode` would send it to an engine: turn 0 is
``ChatFormat.first_prompt(observation)``, each response is the env's answer format
followed by the template's end-of-turn token, and each later turn appends
``ChatFormat.continuation(observation, response)``. A model trained on these ids sees
at training time the very ids the pipeline will feed it.

Every turn records the set of *optimal* actions (all that keep a shortest solution),
not just the one played: the trainer maximises the probability of choosing any of them
(ties between equally short paths are not arbitrary labels to memorise). With
probability ``explore`` a turn plays a random non-losing, non-optimal action instead and
is left out of the loss, so the data also shows states off the expert's path (after
bumping into an edge, one step back) from which the expert recovers.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.chat import ChatFormat
from rollpipe.envs.frozenlake import MOVES as LAKE_MOVES
from rollpipe.envs.frozenlake import FrozenLake
from rollpipe.envs.sokoban import Sokoban
from rollpipe.envs.sokoban_gen import solve

__all__ = ["OBSERVATION", "RESPONSE", "ExpertEpisode", "expert_episode", "optimal_actions"]

RESPONSE = 1
OBSERVATION = 2


@attrs.frozen
class ExpertEpisode:
    """One expert conversation as token ids, with what the trainer learns from it.

    ``ids`` is the whole conversation (every prompt piece and response, in order).
    ``targets[i]`` is the id the model should predict at position ``i`` (``ids[i+1]``)
    or -1 where no loss applies; ``kinds[i]`` says which loss: :data:`RESPONSE` (an
    expert response's tokens other than the action) or :data:`OBSERVATION` (the env's
    feedback after turn 0, which is deterministic given the conversation so far: an
    auxiliary loss that teaches the model where things are on the grid). Each entry of
    ``actions`` is ``(position, optimal_ids)``: the logits at ``position`` should put
    their mass on any of ``optimal_ids`` (the action tokens of the optimal actions).
    """

    env: str
    seed: int
    ids: np.ndarray
    targets: np.ndarray
    kinds: np.ndarray
    actions: tuple[tuple[int, tuple[int, ...]], ...]
    responses: tuple[tuple[int, int], ...]  # (start, end) of each turn's response in ids
    turns: int
    success: bool


def _lake_distances(env: FrozenLake) -> dict[tuple[int, int], int]:
    """Steps from every reachable cell to the goal (holes excluded), by reverse BFS."""
    lake = env.lake
    assert lake is not None
    n = lake.size
    dist = {lake.goal: 0}
    queue = deque([lake.goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in LAKE_MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in dist and not lake.holes[nxt]:
                dist[nxt] = dist[(r, c)] + 1
                queue.append(nxt)
    return dist


def _lake_outcomes(env: FrozenLake) -> dict[str, tuple[int | None, bool]]:
    """For each action: (distance to goal after it or None if it loses, whether it moves)."""
    lake = env.lake
    assert lake is not None
    dist = _lake_distances(env)
    out: dict[str, tuple[int | None, bool]] = {}
    for action, (dr, dc) in LAKE_MOVES.items():
        r, c = env.position[0] + dr, env.position[1] + dc
        if not (0 <= r < lake.size and 0 <= c < lake.size):
            out[action] = (dist.get(env.position), False)
        elif lake.holes[r, c]:
            out[action] = (None, True)
        else:
            out[action] = (dist.get((r, c)), True)
    return out


def _sokoban_outcomes(env: Sokoban) -> dict[str, tuple[int | None, bool]]:
    """For each action: (moves left in a shortest solution after it, None if unsolvable;
    whether the rendered state changes). Uses the env's own transition on a copy."""
    out: dict[str, tuple[int | None, bool]] = {}
    before = env.render()
    for action in env.actions:
        trial = copy.copy(env)  # the room is immutable: a shallow copy steps independently
        trial.step(f"<answer>{action}</answer>")
        assert trial.room is not None
        if trial.room.solved:
            out[action] = (0, True)
            continue
        path = solve(trial.room)
        out[action] = (None if path is None else len(path), trial.render() != before)
    return out


def optimal_actions(env: FrozenLake | Sokoban) -> tuple[list[str], list[str]]:
    """``(optimal, other_safe)``: actions on some shortest solution from the env's current
    state, and the remaining actions that neither lose nor make the puzzle unsolvable."""
    outcomes = _lake_outcomes(env) if isinstance(env, FrozenLake) else _sokoban_outcomes(env)
    finite = [d for d, _ in outcomes.values() if d is not None]
    best = min(finite) if finite else None
    optimal = [a for a, (d, _) in outcomes.items() if d is not None and d == best]
    safe = [a for a, (d, _) in outcomes.items() if d is not None and a not in optimal]
    return optimal, safe


def expert_episode(
    env: FrozenLake | Sokoban,
    seed: int,
    chat: ChatFormat,
    action_ids: dict[str, int],
    *,
    max_turns: int,
    explore: float = 0.0,
    rng: random.Random | None = None,
) -> ExpertEpisode:
    """Play ``env`` from ``seed`` with the expert, written as the pipeline's token ids.

    ``action_ids[action]`` is the token id that carries the action inside the answer
    (e.g. ``>Left``); responses are the env's answer format, tokenized, plus the
    end-of-turn token. ``rng`` draws the played action among the optimal ones and the
    exploration turns (default: seeded from ``seed``).
    """
    tokenizer = chat.tokenizer
    eot = chat.eot_id
    if eot is None:
        raise ValueError("expert_episode needs a chat template with an end-of-turn token")
    rng = rng or random.Random(derive_seed(seed, 7))
    answer_format = env.config.answer_format
    observation, _ = env.reset(seed)
    ids: list[int] = []
    targets: list[int] = []
    kinds: list[int] = []
    actions: list[tuple[int, tuple[int, ...]]] = []
    spans: list[tuple[int, int]] = []
    response: list[int] = []
    success, turns = False, 0
    for t in range(max_turns):
        prompt = (
            chat.first_prompt(observation) if t == 0 else chat.continuation(observation, response)
        )
        start = len(ids)
        ids.extend(prompt)
        targets.extend([-1] * len(prompt))
        kinds.extend([0] * len(prompt))
        if t > 0:  # the env's answer to the previous action (turn 0's grid is random)
            for i, token in enumerate(prompt):
                targets[start + i - 1] = token
                kinds[start + i - 1] = OBSERVATION
        optimal, safe = optimal_actions(env)
        if not optimal:
            break  # nothing keeps the puzzle solvable (cannot happen from a solvable start)
        explored = bool(safe) and rng.random() < explore and t < max_turns - 1
        action = rng.choice(safe if explored else optimal)
        response = [
            *tokenizer(answer_format.format(action=action), add_special_tokens=False)["input_ids"],
            eot,
        ]
        start = len(ids)
        spans.append((start, start + len(response)))
        ids.extend(response)
        targets.extend([-1] * len(response))
        kinds.extend([0] * len(response))
        if not explored:
            position = response.index(action_ids[action])
            for i, token in enumerate(response):
                if i != position:
                    targets[start + i - 1] = token  # logits at p predict the token at p + 1
                    kinds[start + i - 1] = RESPONSE
            actions.append((start + position - 1, tuple(sorted(action_ids[a] for a in optimal))))
        observation, _, terminated, truncated, info = env.step(answer_format.format(action=action))
        turns, success = t + 1, bool(info["success"])
        if terminated or truncated:
            break
    return ExpertEpisode(
        env=env.name,
        seed=seed,
        ids=np.asarray(ids, dtype=np.int64),
        targets=np.asarray(targets, dtype=np.int64),
        kinds=np.asarray(kinds, dtype=np.int8),
        actions=tuple(actions),
        responses=tuple(spans),
        turns=turns,
        success=success,
    )


def action_token_ids(tokenizer: Any, actions: Sequence[str], answer_format: str) -> dict[str, int]:
    """The token that carries each action in ``answer_format`` (where the answers differ).

    Raises if some action's answer differs from the others in more than one token, since
    the trainer's any-optimal-action loss needs one token per action.
    """
    encoded = {
        a: tokenizer(answer_format.format(action=a), add_special_tokens=False)["input_ids"]
        for a in actions
    }
    lengths = {len(v) for v in encoded.values()}
    if len(lengths) != 1:
        raise ValueError(f"answers for {list(actions)} tokenize to different lengths: {encoded}")
    columns = list(zip(*encoded.values(), strict=True))
    differ = [i for i, col in enumerate(columns) if len(set(col)) > 1]
    if len(differ) != 1:
        raise ValueError(
            f"answers for {list(actions)} must differ in exactly one token, got {encoded}"
        )
    return {a: ids[differ[0]] for a, ids in encoded.items()}
