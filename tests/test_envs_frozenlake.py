"""FrozenLake: solvable maps, a scripted optimal policy, holes, slipperiness."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.envs import FrozenLake, LakeMap
from rollpipe.envs.frozenlake import generate_map, shortest_path

STEPS = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}


def bfs_from_text(grid: str) -> list[str]:
    """The test's own BFS on the rendered grid (what the model sees), independent of the env."""
    rows = grid.splitlines()
    cells = {(i, j): ch for i, row in enumerate(rows) for j, ch in enumerate(row)}
    start = next(p for p, ch in cells.items() if ch == "P")
    goal = next(p for p, ch in cells.items() if ch == "G")
    paths: dict[tuple[int, int], list[str]] = {start: []}
    queue = deque([start])
    while queue:
        pos = queue.popleft()
        for action, (dr, dc) in STEPS.items():
            nxt = (pos[0] + dr, pos[1] + dc)
            if cells.get(nxt, "H") != "H" and nxt not in paths:
                paths[nxt] = [*paths[pos], action]
                queue.append(nxt)
    assert goal in paths, f"map is not solvable:\n{grid}"
    return paths[goal]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    size=st.integers(2, 8),
    p_frozen=st.sampled_from([0.6, 0.8, 1.0]),
)
def test_scripted_optimal_policy_solves_every_map(seed: int, size: int, p_frozen: float) -> None:
    env = FrozenLake(size=size, p_frozen=p_frozen, max_steps=4 * size * size)
    obs, _ = env.reset(seed)
    grid = env.render()
    assert len(grid.splitlines()) == size and grid in obs
    plan = bfs_from_text(grid)
    assert len(plan) >= size - 1  # start and goal are never next to each other on big maps
    rewards = []
    for i, action in enumerate(plan):
        obs, reward, terminated, truncated, info = env.step(f"<answer>{action}</answer>")
        rewards.append(reward)
        assert info["action"] == action and info["action_valid"]
        assert terminated is (i == len(plan) - 1) and not truncated
    assert rewards == [0.0] * (len(plan) - 1) + [1.0]
    assert info["success"] is True and env.success and "W" in env.render()


def test_many_seeds_give_solvable_varied_maps() -> None:
    rng_maps = [generate_map(6, 0.7, np.random.default_rng([s, 0])) for s in range(200)]
    assert all(shortest_path(m) is not None for m in rng_maps)
    assert len({(m.start, m.goal) for m in rng_maps}) > 50  # start and goal move around
    assert sum(bool(m.holes.any()) for m in rng_maps) > 150  # and they do have holes


LEVEL = """
P_H
_HG
___
"""


def test_falling_into_a_hole_ends_with_zero() -> None:
    env = FrozenLake(level=LEVEL)
    env.reset(0)
    _, reward, terminated, truncated, info = env.step("<answer>Right</answer>")
    assert (reward, terminated, truncated) == (0.0, False, False)
    obs, reward, terminated, truncated, info = env.step("<answer>Down</answer>")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)
    assert "hole" in obs and env.render().splitlines()[1] == "_XG"


def test_edge_bump_is_a_valid_no_op() -> None:
    env = FrozenLake(level=LEVEL)
    env.reset(0)
    before = env.render()
    obs, reward, terminated, _, info = env.step("<answer>Up</answer>")
    assert env.render() == before and info["action_valid"] and reward == 0.0 and not terminated
    assert "edge" in obs


def test_level_parsing_errors() -> None:
    with pytest.raises(ValueError, match="square"):
        LakeMap.from_text("P_\n_G_")
    with pytest.raises(ValueError, match="exactly one P"):
        LakeMap.from_text("P_\nPG")
    with pytest.raises(ValueError, match="unknown cells"):
        LakeMap.from_text("P#\n_G")


OPEN_LEVEL = "\n".join(["P" + "_" * 9] + ["_" * 10] * 8 + ["_" * 9 + "G"])


def run_actions(env: FrozenLake, seed: int, actions: list[str]) -> list[str]:
    env.reset(seed)
    out = []
    for action in actions:
        if env.done:
            break
        out.append(env.step(f"<answer>{action}</answer>")[0])
    return out


def test_slippery_transitions_are_seeded_and_slip_at_the_configured_rate() -> None:
    actions = ["Right", "Down", "Left", "Up"] * 10
    env = FrozenLake(level=OPEN_LEVEL, slippery=True, max_steps=1000)
    first = run_actions(env, 5, actions)
    assert run_actions(FrozenLake(level=OPEN_LEVEL, slippery=True, max_steps=1000), 5, actions) == (
        first
    )
    assert run_actions(env, 6, actions) != first
    slips = sum(
        "slipped" in obs
        for seed in range(10)
        for obs in run_actions(env, seed, ["Left", "Up"] * 15)
    )
    assert 0.55 < slips / 300 < 0.78  # gymnasium: intended move with probability 1/3


def test_slippery_with_success_rate_one_is_deterministic_movement() -> None:
    actions = ["Right", "Down"] * 9
    sure = run_actions(FrozenLake(level=OPEN_LEVEL, slippery=True, success_rate=1.0), 3, actions)
    plain = run_actions(FrozenLake(level=OPEN_LEVEL), 3, actions)
    assert sure == plain and "reached the goal" in plain[-1]
