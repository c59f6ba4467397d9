"""Sokoban as a text env: push every box onto a target.

Rooms are generated per seed by reverse play (solvable by construction, see
:mod:`rollpipe.envs.sokoban_gen`), or fixed with ``level``. Rewards follow gym-sokoban:
``step_penalty`` every valid move (also into a wall), ``box_on_target_reward`` for
pushing a box onto a target, ``box_off_target_penalty`` for pushing one off, and
``success_reward`` when all boxes are on targets (which terminates). Transitions are
deterministic.
"""

from __future__ import annotations

import functools
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
from rollpipe.envs.sokoban_gen import ACTIONS, MOVES, Room, generate_room


def _to_pair(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _check_dim_room(inst: SokobanConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    ok = isinstance(value, tuple) and len(value) == 2
    if not ok or any(isinstance(v, bool) or not isinstance(v, int) or v < 3 for v in value):
        raise ValueError(f"dim_room must be a pair of ints >= 3 (walls included), got {value!r}")


@attrs.frozen(kw_only=True)
class SokobanConfig(TextEnvConfig):
    """Validated Sokoban settings (see :class:`Sokoban`)."""

    dim_room: tuple[int, int] = attrs.field(converter=_to_pair, validator=_check_dim_room)
    num_boxes: int = attrs.field(validator=int_at_least(1))
    step_penalty: float = attrs.field(validator=finite_number)
    box_on_target_reward: float = attrs.field(validator=finite_number)
    box_off_target_penalty: float = attrs.field(validator=finite_number)
    success_reward: float = attrs.field(validator=finite_number)
    level: str | None = attrs.field(validator=optional_str)

    def __attrs_post_init__(self) -> None:
        h, w = self.dim_room
        need = 2 * self.num_boxes + 2
        if self.level is None and (h - 2) * (w - 2) < need:
            raise ValueError(
                f"dim_room={self.dim_room} is too small for num_boxes={self.num_boxes}: "
                f"the inner area (h-2)*(w-2) needs at least {need} cells"
            )


@functools.lru_cache(maxsize=1024)
def room_for_seed(dim_room: tuple[int, int], num_boxes: int, seed: int) -> Room:
    """The room ``seed`` generates, made once: a GRPO group's members share their seed,
    and generation (about 1 ms) is most of a reset. Rooms are immutable (a push copies
    ``boxes``); the cached arrays are made read-only to keep it so."""
    room = generate_room(dim_room, num_boxes, np.random.default_rng([seed, 0]))
    for grid in (room.walls, room.targets, room.boxes):
        grid.flags.writeable = False
    return room


class Sokoban(GridTextEnv):
    """Sokoban text env; ``level`` (a ``# _ O X * P S`` grid) overrides dim_room/num_boxes."""

    actions: ClassVar[tuple[str, ...]] = ACTIONS
    name: ClassVar[str] = "sokoban"
    blocking: ClassVar[bool] = False
    """Pure Python, microseconds a call: runs inline on the event loop. Not inherited
    (``is_blocking``): a subclass runs on env threads unless it declares it again."""

    def __init__(
        self,
        *,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        format_penalty: float = -0.1,
        step_penalty: float = -0.1,
        box_on_target_reward: float = 1.0,
        box_off_target_penalty: float = -1.0,
        success_reward: float = 10.0,
        level: str | None = None,
        answer_pattern: str = DEFAULT_ANSWER_PATTERN,
        answer_format: str = DEFAULT_ANSWER_FORMAT,
    ) -> None:
        config = SokobanConfig(
            dim_room=dim_room,
            num_boxes=num_boxes,
            max_steps=max_steps,
            format_penalty=format_penalty,
            step_penalty=step_penalty,
            box_on_target_reward=box_on_target_reward,
            box_off_target_penalty=box_off_target_penalty,
            success_reward=success_reward,
            level=level,
            answer_pattern=answer_pattern,
            answer_format=answer_format,
        )
        super().__init__(config)
        self.config: SokobanConfig = config
        self._fixed = Room.from_text(level) if level is not None else None
        self.room: Room | None = None

    @property
    def task(self) -> str:
        return "Sokoban: push every box onto a target. You can push (not pull) one box at a time."

    @property
    def legend(self) -> str:
        return "Legend: # wall, _ floor, O target, X box, * box on target, P you, S you on target."

    @property
    def success(self) -> bool:
        return self.room is not None and self.room.solved

    def _reset_state(self, seed: int) -> None:
        if self._fixed is not None:
            self.room = self._fixed
            return
        self.room = room_for_seed(self.config.dim_room, self.config.num_boxes, seed)

    def _apply(self, action: str) -> tuple[float, bool, str]:
        room = self.room
        assert room is not None
        cfg = self.config
        h, w = room.shape
        dr, dc = MOVES[action]
        r, c = room.player[0] + dr, room.player[1] + dc

        def blocked(i: int, j: int) -> bool:
            return not (0 <= i < h and 0 <= j < w) or bool(room.walls[i, j])

        reward = float(cfg.step_penalty)
        if blocked(r, c):
            return reward, False, f"You moved {action} into a wall; nothing moved."
        boxes = room.boxes
        feedback = f"You moved {action}."
        if boxes[r, c]:
            r2, c2 = r + dr, c + dc
            if blocked(r2, c2) or boxes[r2, c2]:
                return reward, False, f"You pushed {action} but the box is stuck; nothing moved."
            boxes = boxes.copy()
            boxes[r, c], boxes[r2, c2] = False, True
            feedback = f"You pushed a box {action}."
            if room.targets[r2, c2] and not room.targets[r, c]:
                reward += float(cfg.box_on_target_reward)
                feedback = f"You pushed a box {action} onto a target."
            elif room.targets[r, c] and not room.targets[r2, c2]:
                reward += float(cfg.box_off_target_penalty)
                feedback = f"You pushed a box {action} off a target."
        self.room = attrs.evolve(room, boxes=boxes, player=(r, c))
        if self.room.solved:
            return reward + float(cfg.success_reward), True, f"{feedback} All boxes on targets!"
        return reward, False, feedback

    def render(self) -> str:
        return "" if self.room is None else self.room.to_text()
