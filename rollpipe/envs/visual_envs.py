"""Visual FrozenLake and Visual Sokoban: the grid puzzles seen as images (VAGEN-style).

Each wraps its text env (:class:`~rollpipe.envs.frozenlake.FrozenLake`,
:class:`~rollpipe.envs.sokoban.Sokoban`) and changes only what the model sees: the grid
is drawn as an RGB image (:mod:`rollpipe.envs.visual`, ``cell_size`` pixels a cell: a 4x4
lake is 64x64 by default), while the task, a legend of the colours, the answer format and
the feedback stay text. Dynamics, rewards, seeds, action parsing, ``info`` and
``info["metrics"]`` are the text env's own, call for call.

**The observation** is a chat observation: a list of one user message whose ``content``
is a list of content parts (:mod:`rollpipe.envs.content`), the text first, then the
image::

    [{"role": "user", "content": [{"type": "text", "text": "...\\nThe grid:"},
                                  {"type": "image", "image": <PIL.Image.Image>}]}]

As for any env whose observation is not a str, the episode talks to it through the chat
conversation; ``step`` still takes the response text (``step_input`` is ``"text"``).
``image_format="array"`` gives the image as an ``H x W x 3`` uint8 numpy array instead
of a PIL image (PIL is imported only for ``"pil"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import attrs
import numpy as np

from rollpipe._utils.checks import int_in, one_of
from rollpipe.envs.base import GridTextEnv, Info, TextEnvConfig
from rollpipe.envs.frozenlake import FrozenLake
from rollpipe.envs.parsing import DEFAULT_ANSWER_FORMAT, DEFAULT_ANSWER_PATTERN
from rollpipe.envs.sokoban import Sokoban
from rollpipe.envs.visual import (
    FROZENLAKE_TILES,
    MAX_CELL_SIZE,
    MIN_CELL_SIZE,
    SOKOBAN_TILES,
    Tile,
    render_grid,
)

__all__ = ["ImageConfig", "ImageMessages", "VisualFrozenLake", "VisualGridEnv", "VisualSokoban"]

ImageMessages = list[dict[str, Any]]
"""``[{"role": "user", "content": [text part, image part]}]``: a visual env's observation."""

ImageFormat = Literal["pil", "array"]
GRID_CAPTION = "The grid:"


@attrs.frozen(kw_only=True)
class ImageConfig:
    """How a visual env draws its grid: ``cell_size`` pixels a cell side, and the image
    type in the observation (``"pil"``: ``PIL.Image.Image``, ``"array"``: numpy)."""

    cell_size: int = attrs.field(default=16, validator=int_in(MIN_CELL_SIZE, MAX_CELL_SIZE))
    image_format: ImageFormat = attrs.field(default="pil", validator=one_of("pil", "array"))


def _to_pil(pixels: np.ndarray) -> Any:
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow comes with transformers
        raise ImportError(
            "image_format='pil' needs Pillow (pip install pillow); or pass "
            "image_format='array' for numpy images"
        ) from exc
    return Image.fromarray(pixels)


class VisualGridEnv:
    """A grid text env seen as images: subclasses build the text env and name its tiles
    and colour legend. ``text_env`` is the wrapped env (its state: ``lake``, ``room``)."""

    tiles: ClassVar[Mapping[str, Tile]]
    image_legend: ClassVar[str]

    def __init__(self, text_env: GridTextEnv, image: ImageConfig) -> None:
        if text_env.legend not in text_env.instruction:  # the legend line is swapped below
            raise ValueError(f"{type(text_env).__name__}.instruction does not show its legend")
        # its observations hold images: the episode needs the image conversation, which
        # importing rollpipe.vision registers (here, not at module level: text users of
        # rollpipe.envs do not pay for it)
        import rollpipe.vision  # noqa: F401

        self.text_env = text_env
        self.image_config = image

    @property
    def name(self) -> str:
        """The registry's name for this env (``"frozenlake_visual"``)."""
        return f"{self.text_env.name}_visual"

    @property
    def actions(self) -> tuple[str, ...]:
        return self.text_env.actions

    @property
    def config(self) -> TextEnvConfig:
        """The text env's config (dynamics, rewards, answer format)."""
        return self.text_env.config

    @property
    def steps(self) -> int:
        return self.text_env.steps

    @property
    def done(self) -> bool:
        return self.text_env.done

    @property
    def success(self) -> bool:
        return self.text_env.success

    @property
    def instruction(self) -> str:
        """The text env's instruction with the colour legend in place of the symbols'."""
        text = self.text_env
        return text.instruction.replace(text.legend, self.image_legend, 1)

    def render(self) -> str:
        """The current state as the text env's grid (for logs and tests)."""
        return self.text_env.render()

    def render_image(self) -> np.ndarray:
        """The current state as an ``H x W x 3`` uint8 RGB array (the same state always
        gives the same pixels)."""
        return render_grid(self.text_env.render(), self.tiles, self.image_config.cell_size)

    def _observation(self, text: str) -> ImageMessages:
        pixels = self.render_image()
        image = pixels if self.image_config.image_format == "array" else _to_pil(pixels)
        parts = [
            {"type": "text", "text": f"{text}\n{GRID_CAPTION}"},
            {"type": "image", "image": image},
        ]
        return [{"role": "user", "content": parts}]

    def reset(self, seed: int) -> tuple[ImageMessages, Info]:
        """Start an episode (the text env's ``reset``): the instruction and the grid image."""
        _, info = self.text_env.reset(seed)
        return self._observation(self.instruction), info

    def step(self, action_text: str) -> tuple[ImageMessages, float, bool, bool, Info]:
        """The text env's ``step``: its reward, flags and ``info``; its feedback and the grid
        image as the observation."""
        text, reward, terminated, truncated, info = self.text_env.step(action_text)
        grid = "\n" + self.text_env.render()
        if not text.endswith(grid):
            raise RuntimeError(
                f"{type(self.text_env).__name__}.step's observation does not end with its grid"
            )
        return self._observation(text[: -len(grid)]), reward, terminated, truncated, info

    def close(self) -> None:
        self.text_env.close()


class VisualFrozenLake(VisualGridEnv):
    """FrozenLake seen as images: :class:`~rollpipe.envs.frozenlake.FrozenLake`'s keywords,
    plus ``cell_size`` (pixels a cell: 16 draws a 4x4 lake as 64x64) and ``image_format``.

    Examples:
        >>> from rollpipe.envs.content import image_parts, text_of_parts
        >>> env = VisualFrozenLake(level="P_\\n_G", cell_size=8)
        >>> obs, info = env.reset(seed=0)
        >>> print(text_of_parts(obs))
        FrozenLake: walk from P to the goal G on the ice; stepping into a hole H loses.
        Legend (the image): light blue ice, dark blue disc a hole, gold square the goal,
        small red disc you.
        Answer with one action (Left, Down, Right or Up), e.g. <answer>Left</answer>
        The grid:
        <image 16x16>
        >>> obs, reward, terminated, truncated, info = env.step("<answer>Right</answer>")
        >>> print(text_of_parts(obs)), reward, info["action"]
        You moved Right.
        The grid:
        <image 16x16>
        (None, 0.0, 'Right')
        >>> image_parts(obs)[0].size, env.render()
        ((16, 16), '_P\\n_G')
    """

    tiles: ClassVar[Mapping[str, Tile]] = FROZENLAKE_TILES
    image_legend: ClassVar[str] = (
        "Legend (the image): light blue ice, dark blue disc a hole, gold square the goal, "
        "small red disc you."
    )
    blocking: ClassVar[bool] = False
    """Pure Python and numpy, tens of microseconds a call: runs inline on the event loop."""

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
        cell_size: int = 16,
        image_format: ImageFormat = "pil",
    ) -> None:
        image = ImageConfig(cell_size=cell_size, image_format=image_format)
        text = FrozenLake(
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
        super().__init__(text, image)
        self.text_env: FrozenLake = text


class VisualSokoban(VisualGridEnv):
    """Sokoban seen as images: :class:`~rollpipe.envs.sokoban.Sokoban`'s keywords, plus
    ``cell_size`` (pixels a cell: a 6x6 room is 96x96 at 16) and ``image_format``.

    Examples:
        >>> from rollpipe.envs.content import image_parts, text_of_parts
        >>> env = VisualSokoban(level="#####\\n#PXO#\\n#####", image_format="array")
        >>> obs, info = env.reset(seed=0)
        >>> print(text_of_parts(obs).splitlines()[1])
        Legend (the image): brown wall, light grey floor, red ring a target, orange square a
        box, green square a box on a target, blue disc you.
        >>> obs, reward, terminated, truncated, info = env.step("<answer>Right</answer>")
        >>> print(text_of_parts(obs)), reward, terminated, info["success"]
        You pushed a box Right onto a target. All boxes on targets!
        The grid:
        <image 80x48>
        (None, 10.9, True, True)
        >>> image_parts(obs)[0].shape
        (48, 80, 3)
    """

    tiles: ClassVar[Mapping[str, Tile]] = SOKOBAN_TILES
    image_legend: ClassVar[str] = (
        "Legend (the image): brown wall, light grey floor, red ring a target, orange square a "
        "box, green square a box on a target, blue disc you."
    )
    blocking: ClassVar[bool] = False
    """Pure Python and numpy, tens of microseconds a call: runs inline on the event loop."""

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
        cell_size: int = 16,
        image_format: ImageFormat = "pil",
    ) -> None:
        image = ImageConfig(cell_size=cell_size, image_format=image_format)
        text = Sokoban(
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
        super().__init__(text, image)
        self.text_env: Sokoban = text
