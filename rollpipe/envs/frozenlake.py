"""FrozenLake as a text env: walk from P to G over the ice without falling into a hole.

Maps are random per seed (random start and goal at least ``size - 1`` apart) and always
solvable (BFS check; a failing draw is replaced by the next draw of the same generator).
Reward 1 at the goal, 0 elsewhere; a hole ends the episode with 0. With ``slippery`` the
move goes the intended way with probability ``success_rate`` and to either perpendicular
side otherwise (as gymnasium), drawn from the env's own generator seeded in ``reset``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

import attrs
import numpy as np

from rollpipe._utils.checks import int_at_least
from rollpipe.envs.base import (
    GridTextEnv,
    TextEnvConfig,
    finite_number,
    optional_str,
)
from rollpipe.envs.parsing import DEFAULT_ANSWER_FORMAT, DEFAULT_ANSWER_PATTERN

FROZEN, HOLE = "_", "H"
PLAYER, GOAL = "P", "G"
PLAYER_IN_HOLE, PLAYER_ON_GOAL = "X", "W"

ACTIONS: tuple[str, ...] = ("Left", "Down", "Right", "Up")
MOVES: dict[str, tuple[int, int]] = {
    "Left": (0, -1),
    "Down": (1, 0),
    "Right": (0, 1),
    "Up": (-1, 0),
}
_PERPENDICULAR = {"Left": ("Up", "Down"), "Right": ("Down", "Up"), "Up": ("Right", "Left")}
_PERPENDICULAR["Down"] = ("Left", "Right")
MAX_MAP_TRIES = 10_000


def _probability(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    finite_number(inst, attribute, value)
    if not 0.0 < float(value) <= 1.0:  # type: ignore[arg-type]
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value!r}")


@attrs.frozen(kw_only=True)
class FrozenLakeConfig(TextEnvConfig):
    """Validated FrozenLake settings (see :class:`FrozenLake`)."""

    size: int = attrs.field(validator=int_at_least(2))
    p_frozen: float = attrs.field(validator=_probability)
    slippery: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    success_rate: float = attrs.field(validator=_probability)
    level: str | None = attrs.field(validator=optional_str)


@attrs.frozen
class LakeMap:
    """A FrozenLake map: ``holes`` is a bool [size, size] array; start/goal are (row, col)."""

    holes: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    start: tuple[int, int]
    goal: tuple[int, int]

    @property
    def size(self) -> int:
        return int(self.holes.shape[0])

    @classmethod
    def from_text(cls, text: str) -> LakeMap:
        """Parse a square grid of ``_ H P G`` (one row per line)."""
        rows = [line.strip() for line in text.strip().splitlines() if line.strip()]
        if not rows or any(len(r) != len(rows) for r in rows):
            raise ValueError(f"level must be a square grid of {FROZEN}{HOLE}{PLAYER}{GOAL}")
        bad = {c for r in rows for c in r} - {FROZEN, HOLE, PLAYER, GOAL}
        if bad:
            raise ValueError(
                f"level has unknown cells {sorted(bad)}; use {FROZEN}{HOLE}{PLAYER}{GOAL}"
            )
        cells = [(i, j, c) for i, r in enumerate(rows) for j, c in enumerate(r)]
        starts = [(i, j) for i, j, c in cells if c == PLAYER]
        goals = [(i, j) for i, j, c in cells if c == GOAL]
        if len(starts) != 1 or len(goals) != 1:
            raise ValueError(f"level needs exactly one {PLAYER} and one {GOAL}")
        holes = np.array([[c == HOLE for c in r] for r in rows], dtype=bool)
        return cls(holes=holes, start=starts[0], goal=goals[0])


def shortest_path(lake: LakeMap) -> list[str] | None:
    """A shortest action sequence from start to goal avoiding holes (BFS), or None."""
    n = lake.size
    parent: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {lake.start: None}
    queue = deque([lake.start])
    while queue:
        pos = queue.popleft()
        if pos == lake.goal:
            path: list[str] = []
            link = parent[pos]
            while link is not None:
                pos, action = link
                path.append(action)
                link = parent[pos]
            return path[::-1]
        for action, (dr, dc) in MOVES.items():
            nxt = (pos[0] + dr, pos[1] + dc)
            if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in parent and not lake.holes[nxt]:
                parent[nxt] = (pos, action)
                queue.append(nxt)
    return None


def generate_map(size: int, p_frozen: float, rng: np.random.Generator) -> LakeMap:
    """A random solvable map; draws again from ``rng`` until BFS finds a path."""
    cells = size * size
    for _ in range(MAX_MAP_TRIES):
        holes = rng.random((size, size)) >= p_frozen
        start_i, goal_i = (int(x) for x in rng.choice(cells, size=2, replace=False))
        start, goal = divmod(start_i, size), divmod(goal_i, size)
        if abs(start[0] - goal[0]) + abs(start[1] - goal[1]) < size - 1:
            continue
        holes[start] = holes[goal] = False
        lake = LakeMap(holes=holes, start=start, goal=goal)
        if shortest_path(lake) is not None:
            return lake
    raise RuntimeError(
        f"no solvable FrozenLake map in {MAX_MAP_TRIES} draws with size={size}, "
        f"p_frozen={p_frozen}; raise p_frozen"
    )


class FrozenLake(GridTextEnv):
    """FrozenLake text env; ``level`` (a ``_ H P G`` grid) fixes the map instead of generating."""

    actions: ClassVar[tuple[str, ...]] = ACTIONS
    name: ClassVar[str] = "frozenlake"
    blocking: ClassVar[bool] = False
    """Pure Python, microseconds a call: runs inline on the event loop. Not inherited
    (``is_blocking``): a subclass runs on env threads unless it declares it again."""

    def __init__(
        self,
        *,
        size: int = 4,
        p_frozen: float = 0.8,
        slippery: bool = False,
        success_rate: float = 1.0 / 3.0,
        max_steps: int = 100,
        format_penalty: float = -0.1,
        level: str | None = None,
        answer_pattern: str = DEFAULT_ANSWER_PATTERN,
        answer_format: str = DEFAULT_ANSWER_FORMAT,
    ) -> None:
        config = FrozenLakeConfig(
            size=size,
            p_frozen=p_frozen,
            slippery=slippery,
            success_rate=success_rate,
            max_steps=max_steps,
            format_penalty=format_penalty,
            level=level,
            answer_pattern=answer_pattern,
            answer_format=answer_format,
        )
        super().__init__(config)
        self.config: FrozenLakeConfig = config
        self._fixed = LakeMap.from_text(level) if level is not None else None
        self.lake: LakeMap | None = None
        self.position: tuple[int, int] = (0, 0)
        self._rng = np.random.default_rng(0)

    @property
    def task(self) -> str:
        return "FrozenLake: walk from P to the goal G on the ice; stepping into a hole H loses."

    @property
    def legend(self) -> str:
        return "Legend: P you, _ ice, H hole, G goal, X you in a hole, W you on the goal."

    @property
    def success(self) -> bool:
        return self.lake is not None and self.position == self.lake.goal

    def _reset_state(self, seed: int) -> None:
        # Separate streams for the map and the transitions, both from the seed alone.
        map_rng = np.random.default_rng([seed, 0])
        self._rng = np.random.default_rng([seed, 1])
        cfg = self.config
        if self._fixed is not None:
            self.lake = self._fixed
        else:
            self.lake = generate_map(cfg.size, cfg.p_frozen, map_rng)
        self.position = self.lake.start

    def _apply(self, action: str) -> tuple[float, bool, str]:
        assert self.lake is not None
        moved = action
        if self.config.slippery and self._rng.random() >= self.config.success_rate:
            moved = _PERPENDICULAR[action][int(self._rng.integers(2))]
        dr, dc = MOVES[moved]
        r, c = self.position[0] + dr, self.position[1] + dc
        n = self.lake.size
        slip = "" if moved == action else f" but slipped {moved}"
        if not (0 <= r < n and 0 <= c < n):
            return 0.0, False, f"You chose {action}{slip}; the edge stopped you."
        self.position = (r, c)
        if self.lake.holes[r, c]:
            return 0.0, True, f"You chose {action}{slip} and fell into a hole."
        if self.position == self.lake.goal:
            return 1.0, True, f"You chose {action}{slip} and reached the goal!"
        return 0.0, False, f"You moved {moved}." if not slip else f"You chose {action}{slip}."

    def render(self) -> str:
        if self.lake is None:
            return ""
        grid = np.where(self.lake.holes, HOLE, FROZEN).astype("<U1")
        grid[self.lake.goal] = GOAL
        in_hole = bool(self.lake.holes[self.position])
        at_goal = self.position == self.lake.goal
        grid[self.position] = PLAYER_IN_HOLE if in_hole else PLAYER_ON_GOAL if at_goal else PLAYER
        return "\n".join("".join(row) for row in grid)
