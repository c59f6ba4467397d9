"""Grid images: a text grid drawn as an RGB image, one coloured tile per cell.

A :class:`Tile` is a background colour with shapes drawn on it, centred in the cell
(``disc``, ``ring``, ``square``, ``diamond``). A palette maps each character of a text
grid to its tile, so the image is drawn from the env's own text rendering (the one state
both versions share) and the same state always gives the same pixels: the drawing is
plain numpy arithmetic on pixel centres, with no antialiasing, fonts or randomness.
:data:`FROZENLAKE_TILES` and :data:`SOKOBAN_TILES` draw the two grid puzzles.

Examples:
    >>> pixels = render_grid("P_\\nHG", FROZENLAKE_TILES, cell_size=8)
    >>> pixels.shape, pixels.dtype
    ((16, 16, 3), dtype('uint8'))
    >>> tuple(int(v) for v in pixels[4, 4]) == FROZENLAKE_TILES["P"].centre
    True
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Literal

import attrs
import numpy as np

__all__ = [
    "FROZENLAKE_TILES",
    "MAX_CELL_SIZE",
    "MIN_CELL_SIZE",
    "SOKOBAN_TILES",
    "Shape",
    "Tile",
    "render_grid",
    "tile_pixels",
]

Shape = Literal["disc", "ring", "square", "diamond"]
RGB = tuple[int, int, int]
MIN_CELL_SIZE = 4
"""The smallest cell (pixels a side) whose shapes still differ from each other."""
MAX_CELL_SIZE = 256


def _rgb(inst: object, attribute: attrs.Attribute[RGB], value: object) -> None:
    channels = value if isinstance(value, tuple) and len(value) == 3 else ()
    if not channels or any(
        isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 255 for v in channels
    ):
        raise ValueError(
            f"{attribute.name} must be an (r, g, b) tuple of ints 0-255, got {value!r}"
        )


@attrs.frozen
class Tile:
    """One cell kind: a ``background`` colour, then ``layers`` of ``(shape, colour,
    radius)`` drawn in order, ``radius`` a fraction of the cell (0.5 touches its edges)."""

    background: RGB = attrs.field(validator=_rgb)
    layers: tuple[tuple[Shape, RGB, float], ...] = ()

    @property
    def centre(self) -> RGB:
        """The colour at the cell's centre: the last layer's (a ring's hole shows what is
        under it), else the background."""
        for shape, colour, _ in reversed(self.layers):
            if shape != "ring":
                return colour
        return self.background


def _mask(shape: Shape, radius: float, cell_size: int) -> np.ndarray:
    """Which pixels of a ``cell_size`` cell ``shape`` covers (pixel centres, cell units)."""
    at = (np.arange(cell_size) + 0.5) / cell_size - 0.5
    y, x = at[:, None], at[None, :]
    if shape == "disc":
        return np.asarray(x * x + y * y <= radius * radius)
    if shape == "ring":
        inner = radius * 0.6
        d2 = x * x + y * y
        return np.asarray((d2 <= radius * radius) & (d2 >= inner * inner))
    if shape == "square":
        return np.asarray(np.maximum(abs(x), abs(y)) <= radius)
    if shape == "diamond":
        return np.asarray(abs(x) + abs(y) <= radius)
    raise ValueError(f"unknown shape {shape!r}; use disc, ring, square or diamond")


@functools.lru_cache(maxsize=256)
def tile_pixels(tile: Tile, cell_size: int) -> np.ndarray:
    """``tile`` drawn as a read-only ``cell_size x cell_size x 3`` uint8 array (cached).

    Examples:
        >>> tile_pixels(Tile((0, 0, 0), (("disc", (255, 0, 0), 0.3),)), 4)[:, :, 0]
        array([[  0,   0,   0,   0],
               [  0, 255, 255,   0],
               [  0, 255, 255,   0],
               [  0,   0,   0,   0]], dtype=uint8)
    """
    pixels = np.empty((cell_size, cell_size, 3), dtype=np.uint8)
    pixels[:] = tile.background
    for shape, colour, radius in tile.layers:
        pixels[_mask(shape, radius, cell_size)] = colour
    pixels.flags.writeable = False
    return pixels


def render_grid(grid: str, tiles: Mapping[str, Tile], cell_size: int) -> np.ndarray:
    """The text ``grid`` (one row per line) as an ``H x W x 3`` uint8 RGB array, each
    character drawn as its tile in ``tiles``, ``cell_size`` pixels a side."""
    if isinstance(cell_size, bool) or not isinstance(cell_size, int):
        raise ValueError(f"cell_size must be an int, got {cell_size!r}")
    if not MIN_CELL_SIZE <= cell_size <= MAX_CELL_SIZE:
        raise ValueError(
            f"cell_size must be in [{MIN_CELL_SIZE}, {MAX_CELL_SIZE}], got {cell_size}"
        )
    rows = grid.splitlines()
    width = max((len(r) for r in rows), default=0)
    if not rows or any(len(r) != width for r in rows):
        raise ValueError(f"grid must be non-empty rows of equal length, got {grid!r}")
    out = np.empty((len(rows) * cell_size, width * cell_size, 3), dtype=np.uint8)
    for i, row in enumerate(rows):
        for j, char in enumerate(row):
            tile = tiles.get(char)
            if tile is None:
                raise ValueError(
                    f"grid cell ({i}, {j}) is {char!r}; the tiles draw {sorted(tiles)}"
                )
            out[i * cell_size : (i + 1) * cell_size, j * cell_size : (j + 1) * cell_size] = (
                tile_pixels(tile, cell_size)
            )
    return out


# ---- the two palettes (colours named in the envs' legends) --------------------------

ICE: RGB = (200, 230, 255)  # light blue
HOLE_BLUE: RGB = (20, 40, 110)  # dark blue
GOAL_GOLD: RGB = (240, 190, 0)  # gold
AGENT_RED: RGB = (220, 30, 30)  # red

FROZENLAKE_TILES: Mapping[str, Tile] = {
    "_": Tile(ICE),
    "H": Tile(ICE, (("disc", HOLE_BLUE, 0.45),)),
    "G": Tile(ICE, (("square", GOAL_GOLD, 0.38),)),
    "P": Tile(ICE, (("disc", AGENT_RED, 0.28),)),
    "X": Tile(ICE, (("disc", HOLE_BLUE, 0.45), ("disc", AGENT_RED, 0.28))),
    "W": Tile(ICE, (("square", GOAL_GOLD, 0.38), ("disc", AGENT_RED, 0.28))),
}
"""FrozenLake's cells (the text grid's ``_ H P G X W``): light blue ice, a dark blue disc
for a hole, a gold square for the goal, a small red disc for you."""

WALL: RGB = (110, 60, 30)  # brown
FLOOR: RGB = (215, 215, 215)  # light grey
TARGET_RED: RGB = (210, 40, 40)  # red ring
BOX_ORANGE: RGB = (240, 150, 30)  # orange
BOX_GREEN: RGB = (40, 170, 60)  # green: a box on a target
PLAYER_BLUE: RGB = (30, 80, 220)  # blue

SOKOBAN_TILES: Mapping[str, Tile] = {
    "#": Tile(WALL),
    "_": Tile(FLOOR),
    "O": Tile(FLOOR, (("ring", TARGET_RED, 0.42),)),
    "X": Tile(FLOOR, (("square", BOX_ORANGE, 0.36),)),
    "*": Tile(FLOOR, (("ring", TARGET_RED, 0.48), ("square", BOX_GREEN, 0.28))),
    "P": Tile(FLOOR, (("disc", PLAYER_BLUE, 0.32),)),
    "S": Tile(FLOOR, (("ring", TARGET_RED, 0.42), ("disc", PLAYER_BLUE, 0.22))),
}
"""Sokoban's cells (the text grid's ``# _ O X * P S``): brown walls, light grey floor, a
red ring for a target, an orange square for a box, a green square for a box on a target,
a blue disc for you."""
