"""Sokoban rooms: the state record, seeded generation by reverse play, and a BFS solver.

Generation (numpy, no gym-sokoban): carve a room by a random walk inside the outer
walls, put every box on its target, then play *backwards* (the player walks and pulls
boxes). Every pull is the reverse of a legal push, so the forward puzzle is solvable by
construction. Among a few reverse plays the one that moved the boxes furthest is kept,
and no box may start on a target.
"""

from __future__ import annotations

from collections import deque

import attrs
import numpy as np

WALL, FLOOR, TARGET = "#", "_", "O"
BOX, BOX_ON_TARGET = "X", "*"
PLAYER, PLAYER_ON_TARGET = "P", "S"
SYMBOLS = WALL + FLOOR + TARGET + BOX + BOX_ON_TARGET + PLAYER + PLAYER_ON_TARGET

ACTIONS: tuple[str, ...] = ("Up", "Down", "Left", "Right")
MOVES: dict[str, tuple[int, int]] = {
    "Up": (-1, 0),
    "Down": (1, 0),
    "Left": (0, -1),
    "Right": (0, 1),
}

_ARRAY_EQ = attrs.cmp_using(eq=np.array_equal)
MAX_ROOM_TRIES = 1000
_CANDIDATES = 4
_PULL_PROB = 0.8
_FLOOR_FRACTION = 0.6


@attrs.frozen
class Room:
    """A Sokoban state: bool [H, W] arrays ``walls``/``targets``/``boxes`` and the player."""

    walls: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    targets: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    boxes: np.ndarray = attrs.field(eq=_ARRAY_EQ)
    player: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.walls.shape[0]), int(self.walls.shape[1]))

    @property
    def num_boxes(self) -> int:
        return int(self.boxes.sum())

    @property
    def solved(self) -> bool:
        return bool(np.array_equal(self.boxes, self.boxes & self.targets))

    def to_text(self) -> str:
        """The grid in ``# _ O X * P S`` notation, one row per line."""
        grid = np.full(self.walls.shape, FLOOR, dtype="<U1")
        grid[self.targets] = TARGET
        grid[self.walls] = WALL
        grid[self.boxes] = BOX
        grid[self.boxes & self.targets] = BOX_ON_TARGET
        grid[self.player] = PLAYER_ON_TARGET if self.targets[self.player] else PLAYER
        return "\n".join("".join(row) for row in grid)

    @classmethod
    def from_text(cls, text: str) -> Room:
        """Parse a rectangular grid in ``# _ O X * P S`` notation (the inverse of to_text)."""
        rows = [line.strip() for line in text.strip().splitlines() if line.strip()]
        if not rows or any(len(r) != len(rows[0]) for r in rows):
            raise ValueError(f"level must be a non-empty rectangular grid of {SYMBOLS!r}")
        grid = np.array([list(r) for r in rows], dtype="<U1")
        bad = set(np.unique(grid).tolist()) - set(SYMBOLS)
        if bad:
            raise ValueError(f"level has unknown cells {sorted(bad)}; use {SYMBOLS!r}")
        players = np.argwhere(np.isin(grid, [PLAYER, PLAYER_ON_TARGET]))
        if len(players) != 1:
            raise ValueError(f"level needs exactly one player ({PLAYER} or {PLAYER_ON_TARGET})")
        boxes = np.isin(grid, [BOX, BOX_ON_TARGET])
        targets = np.isin(grid, [TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET])
        if boxes.sum() == 0 or boxes.sum() != targets.sum():
            raise ValueError(
                f"level needs as many targets as boxes (at least one); "
                f"got {int(boxes.sum())} boxes and {int(targets.sum())} targets"
            )
        player = (int(players[0][0]), int(players[0][1]))
        return cls(walls=grid == WALL, targets=targets, boxes=boxes, player=player)


def _carve(shape: tuple[int, int], need: int, rng: np.random.Generator) -> np.ndarray:
    """Floor mask carved by a random walk inside the outer walls.

    Walks until ``_FLOOR_FRACTION`` of the inner area (and at least ``need`` cells) is floor.
    """
    h, w = shape
    need = max(need, round(_FLOOR_FRACTION * (h - 2) * (w - 2)))
    floor = np.zeros(shape, dtype=bool)
    r, c = int(rng.integers(1, h - 1)), int(rng.integers(1, w - 1))
    deltas = list(MOVES.values())
    direction = deltas[int(rng.integers(4))]
    for _ in range(100 * h * w):
        if floor.sum() >= need:
            break
        floor[r, c] = True
        if rng.random() < 0.5:  # widen the corridor sideways
            dr, dc = deltas[int(rng.integers(4))]
            floor[min(max(r + dr, 1), h - 2), min(max(c + dc, 1), w - 2)] = True
        if rng.random() < 0.35:
            direction = deltas[int(rng.integers(4))]
        r = min(max(r + direction[0], 1), h - 2)
        c = min(max(c + direction[1], 1), w - 2)
    return floor


def _reverse_play(
    floor: np.ndarray, num_boxes: int, steps: int, rng: np.random.Generator
) -> tuple[int, Room] | None:
    """Place boxes on targets and play backwards.

    Returns the visited state with the largest total box displacement and no box on a
    target (player moved to a random reachable cell), as ``(displacement, room)``, or
    None if no visited state qualifies.
    """
    w = floor.shape[1]
    cells = np.flatnonzero(floor)
    picks = [int(x) for x in rng.choice(cells, size=num_boxes + 1, replace=False)]
    targets, player = picks[:-1], picks[-1]
    target_set = set(targets)
    boxes = list(targets)
    deltas = [dr * w + dc for dr, dc in MOVES.values()]
    flat_floor = floor.ravel()
    best: tuple[int, list[int], int] | None = None
    for _ in range(steps):
        d = deltas[int(rng.integers(4))]
        nxt = player + d
        if not flat_floor[nxt] or nxt in boxes:
            continue
        behind = player - d
        pulled = behind in boxes and rng.random() < _PULL_PROB
        if pulled:
            boxes[boxes.index(behind)] = player
        player = nxt
        if pulled and target_set.isdisjoint(boxes):
            score = sum(
                abs(b // w - t // w) + abs(b % w - t % w)
                for b, t in zip(boxes, targets, strict=True)
            )
            if best is None or score > best[0]:
                best = (score, list(boxes), player)
    if best is None:
        return None
    score, best_boxes, best_player = best
    # Move the player to a random cell it can walk to without pushing: walking back is
    # always possible, so the room stays solvable, and the first push is no longer given.
    reach, frontier = {best_player}, [best_player]
    while frontier:
        cell = frontier.pop()
        for d in deltas:
            nxt = cell + d
            if flat_floor[nxt] and nxt not in reach and nxt not in best_boxes:
                reach.add(nxt)
                frontier.append(nxt)
    best_player = int(rng.choice(sorted(reach)))
    target_mask = np.zeros(floor.size, dtype=bool)
    target_mask[targets] = True
    box_mask = np.zeros(floor.size, dtype=bool)
    box_mask[best_boxes] = True
    room = Room(
        walls=~floor,
        targets=target_mask.reshape(floor.shape),
        boxes=box_mask.reshape(floor.shape),
        player=divmod(best_player, w),
    )
    return score, room


def generate_room(dim_room: tuple[int, int], num_boxes: int, rng: np.random.Generator) -> Room:
    """A random solvable room of ``dim_room`` (outer walls included) with ``num_boxes``."""
    h, w = dim_room
    need = 2 * num_boxes + 2
    if h < 3 or w < 3 or (h - 2) * (w - 2) < need:
        raise ValueError(
            f"dim_room={dim_room} is too small for num_boxes={num_boxes}: the inner "
            f"(h-2)*(w-2) area needs at least {need} cells"
        )
    steps = 3 * (h + w) * num_boxes
    for _ in range(MAX_ROOM_TRIES):
        floor = _carve((h, w), need, rng)
        best: tuple[int, Room] | None = None
        for _ in range(_CANDIDATES):
            cand = _reverse_play(floor, num_boxes, steps, rng)
            if cand is not None and (best is None or cand[0] > best[0]):
                best = cand
        if best is not None:
            return best[1]
    raise RuntimeError(
        f"no Sokoban room found in {MAX_ROOM_TRIES} tries for dim_room={dim_room}, "
        f"num_boxes={num_boxes}; use a larger room or fewer boxes"
    )


def solve(room: Room, max_states: int = 200_000) -> list[str] | None:
    """A shortest move sequence solving ``room`` (BFS over player+box states), or None.

    None means proven unsolvable; a search beyond ``max_states`` raises RuntimeError.
    Meant for small rooms (tests, difficulty checks), not for large levels.
    """
    h, w = room.shape
    open_ = ~room.walls
    targets = frozenset(int(i) for i in np.flatnonzero(room.targets))

    def free(r: int, c: int) -> bool:
        return 0 <= r < h and 0 <= c < w and bool(open_[r, c])

    def dead(i: int) -> bool:  # a box in a non-target corner can never move again
        if i in targets:
            return False
        r, c = divmod(i, w)
        vertical = not free(r - 1, c) or not free(r + 1, c)
        horizontal = not free(r, c - 1) or not free(r, c + 1)
        return vertical and horizontal

    start = (room.player[0] * w + room.player[1], tuple(int(i) for i in np.flatnonzero(room.boxes)))
    parent: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, tuple[int, ...]], str] | None]
    parent = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        if targets.issuperset(boxes):
            path: list[str] = []
            link = parent[state]
            while link is not None:
                state, action = link
                path.append(action)
                link = parent[state]
            return path[::-1]
        pr, pc = divmod(player, w)
        for action, (dr, dc) in MOVES.items():
            if not free(pr + dr, pc + dc):
                continue
            nxt = (pr + dr) * w + pc + dc
            new_boxes = boxes
            if nxt in boxes:
                if not free(pr + 2 * dr, pc + 2 * dc):
                    continue
                beyond = (pr + 2 * dr) * w + pc + 2 * dc
                if beyond in boxes or dead(beyond):
                    continue
                new_boxes = tuple(sorted(beyond if b == nxt else b for b in boxes))
            new_state = (nxt, new_boxes)
            if new_state not in parent:
                if len(parent) >= max_states:
                    raise RuntimeError(f"solve() gave up after max_states={max_states} states")
                parent[new_state] = (state, action)
                queue.append(new_state)
    return None
