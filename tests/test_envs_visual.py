"""Visual FrozenLake and Visual Sokoban: the text envs' dynamics, the grid drawn as pixels,
content-part observations and their checks."""

from __future__ import annotations

import doctest
import importlib
import inspect
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from rollpipe.envs import (
    ContentError,
    EnvRegistryError,
    EnvStateError,
    FrozenLake,
    Sokoban,
    VisualFrozenLake,
    VisualSokoban,
    config_keys,
    image_parts,
    is_blocking,
    make,
    text_of_parts,
)
from rollpipe.envs.content import check_parts, parts_of
from rollpipe.envs.registry import check_env
from rollpipe.envs.visual import (
    AGENT_RED,
    BOX_GREEN,
    BOX_ORANGE,
    FLOOR,
    FROZENLAKE_TILES,
    GOAL_GOLD,
    HOLE_BLUE,
    ICE,
    MAX_CELL_SIZE,
    MIN_CELL_SIZE,
    PLAYER_BLUE,
    SOKOBAN_TILES,
    WALL,
    render_grid,
    tile_pixels,
)
from rollpipe.envs.visual_envs import GRID_CAPTION, VisualGridEnv

ACTION_TEXTS = [
    "<answer>Left</answer>",
    "<answer>Right</answer>",
    "<answer>Up</answer>",
    "<answer>Down</answer>",
    "<answer>Jump</answer>",  # invalid: the format penalty
    "no answer at all",
]


def pixels_of(obs: Any) -> np.ndarray:
    (image,) = image_parts(obs)
    return np.asarray(image)


def feedback_of(obs: Any) -> str:
    """The observation's text part, without the grid caption."""
    (message,) = obs
    text = message["content"][0]["text"]
    assert text.endswith("\n" + GRID_CAPTION)
    return str(text[: -len(GRID_CAPTION) - 1])


def assert_in_lockstep(text_env: Any, visual: VisualGridEnv, seed: int, actions: list[int]) -> None:
    """The visual env's every return equals the text env's, but for the observation: its
    text is the text env's feedback and its image draws the text env's grid."""
    text_obs, text_info = text_env.reset(seed)
    obs, info = visual.reset(seed)
    assert info == text_info
    assert text_obs == f"{text_env.instruction}\n{text_env.render()}"
    assert visual.render() == text_env.render()
    cell = visual.image_config.cell_size
    assert np.array_equal(pixels_of(obs), render_grid(text_env.render(), visual.tiles, cell))
    for a in actions:
        if text_env.done:
            break
        text_obs, *text_rest = text_env.step(ACTION_TEXTS[a])
        obs, *rest = visual.step(ACTION_TEXTS[a])
        assert rest == text_rest  # reward, terminated, truncated, info (metrics included)
        assert visual.render() == text_env.render()
        assert text_obs == f"{feedback_of(obs)}\n{text_env.render()}"
        assert np.array_equal(pixels_of(obs), render_grid(text_env.render(), visual.tiles, cell))
        assert (visual.steps, visual.done, visual.success) == (
            text_env.steps,
            text_env.done,
            text_env.success,
        )


# ---- same dynamics ----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    size=st.integers(2, 6),
    slippery=st.booleans(),
    max_steps=st.integers(1, 30),
    actions=st.lists(st.integers(0, len(ACTION_TEXTS) - 1), max_size=40),
)
def test_visual_frozenlake_follows_the_text_env(
    seed: int, size: int, slippery: bool, max_steps: int, actions: list[int]
) -> None:
    config = {"size": size, "slippery": slippery, "max_steps": max_steps}
    visual = VisualFrozenLake(**config, cell_size=4, image_format="array")
    assert_in_lockstep(FrozenLake(**config), visual, seed, actions)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    dim_room=st.sampled_from([(5, 5), (6, 6), (6, 7)]),
    num_boxes=st.integers(1, 2),
    actions=st.lists(st.integers(0, len(ACTION_TEXTS) - 1), max_size=40),
)
def test_visual_sokoban_follows_the_text_env(
    seed: int, dim_room: tuple[int, int], num_boxes: int, actions: list[int]
) -> None:
    config = {"dim_room": dim_room, "num_boxes": num_boxes, "max_steps": 25}
    visual = VisualSokoban(**config, cell_size=5)  # PIL images: compared as arrays
    assert_in_lockstep(Sokoban(**config), visual, seed, actions)


def test_the_instruction_swaps_only_the_legend() -> None:
    text, visual = FrozenLake(), VisualFrozenLake()
    assert visual.instruction == text.instruction.replace(text.legend, visual.image_legend)
    assert visual.image_legend in visual.instruction and text.legend not in visual.instruction
    obs, _ = visual.reset(7)
    assert feedback_of(obs) == visual.instruction
    sokoban = VisualSokoban()
    assert sokoban.instruction.splitlines()[1] == sokoban.image_legend


def test_step_before_reset_and_after_the_end_fail_as_the_text_env() -> None:
    env = VisualFrozenLake(level="PG\n__")
    with pytest.raises(EnvStateError, match="before reset"):
        env.step("<answer>Right</answer>")
    env.reset(0)
    _, reward, terminated, _, info = env.step("<answer>Right</answer>")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    with pytest.raises(EnvStateError, match="after the episode ended"):
        env.step("<answer>Left</answer>")
    env.close()


# ---- the observation --------------------------------------------------------------


def test_the_observation_is_one_user_message_of_text_then_image() -> None:
    obs, _ = VisualFrozenLake().reset(3)
    assert isinstance(obs, list) and len(obs) == 1 and obs[0]["role"] == "user"
    parts = obs[0]["content"]
    assert [p["type"] for p in parts] == ["text", "image"]
    assert check_parts(parts) == parts
    image = parts[1]["image"]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (64, 64)
    assert text_of_parts(obs).endswith(f"{GRID_CAPTION}\n<image 64x64>")
    array_obs, _ = VisualFrozenLake(image_format="array").reset(3)
    (array,) = image_parts(array_obs)
    assert array.dtype == np.uint8 and array.shape == (64, 64, 3)
    assert np.array_equal(array, np.asarray(image))


@settings(max_examples=25, deadline=None)
@given(size=st.integers(2, 7), cell_size=st.integers(MIN_CELL_SIZE, 32))
def test_the_image_size_follows_the_config(size: int, cell_size: int) -> None:
    obs, _ = VisualFrozenLake(size=size, cell_size=cell_size).reset(0)
    assert image_parts(obs)[0].size == (size * cell_size, size * cell_size)


@pytest.mark.parametrize("dim_room", [(5, 5), (6, 8), (8, 6)])
def test_the_sokoban_image_is_width_by_height_of_the_room(dim_room: tuple[int, int]) -> None:
    obs, _ = VisualSokoban(dim_room=dim_room, cell_size=10).reset(1)
    height, width = dim_room
    assert image_parts(obs)[0].size == (width * 10, height * 10)
    assert f"<image {width * 10}x{height * 10}>" in text_of_parts(obs)


@pytest.mark.parametrize("bad", [0, 3, 257, 16.0, True, "16"])
def test_a_bad_cell_size_fails_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="cell_size"):
        VisualFrozenLake(cell_size=bad)  # type: ignore[arg-type]


def test_a_bad_image_format_fails_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"image_format must be one of \('pil', 'array'\)"):
        VisualSokoban(image_format="png")  # type: ignore[arg-type]


# ---- the pixels -------------------------------------------------------------------


def test_rendering_is_deterministic() -> None:
    for cls in (VisualFrozenLake, VisualSokoban):
        a, b = cls(), cls()
        obs_a, _ = a.reset(11)
        obs_b, _ = b.reset(11)
        assert pixels_of(obs_a).tobytes() == pixels_of(obs_b).tobytes()
        for text in ACTION_TEXTS[:4]:
            obs_a, *_ = a.step(text)
            obs_b, *_ = b.step(text)
            assert pixels_of(obs_a).tobytes() == pixels_of(obs_b).tobytes()
        again, _ = a.reset(11)  # the same state again: the same pixels
        assert np.array_equal(pixels_of(again), pixels_of(b.reset(11)[0]))


@pytest.mark.parametrize("tiles", [FROZENLAKE_TILES, SOKOBAN_TILES], ids=["lake", "sokoban"])
def test_every_cell_kind_draws_differently(tiles: Any) -> None:
    for cell_size in [*range(MIN_CELL_SIZE, 65), 100, 128, MAX_CELL_SIZE]:
        drawn = {c: tile_pixels(t, cell_size).tobytes() for c, t in tiles.items()}
        assert len(set(drawn.values())) == len(tiles), f"two kinds look alike at {cell_size}px"


def _grids(chars: str) -> st.SearchStrategy[str]:
    row = st.integers(1, 5).flatmap(lambda w: st.lists(st.text(chars, min_size=w, max_size=w)))
    return row.filter(bool).map("\n".join)


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    palette=st.sampled_from([FROZENLAKE_TILES, SOKOBAN_TILES]),
    cell_size=st.integers(MIN_CELL_SIZE, 12),
)
def test_different_states_give_different_pixels(
    data: st.DataObject, palette: Any, cell_size: int
) -> None:
    chars = "".join(palette)
    a, b = data.draw(_grids(chars)), data.draw(_grids(chars))
    same_pixels = np.array_equal(
        render_grid(a, palette, cell_size), render_grid(b, palette, cell_size)
    )
    assert same_pixels == (a == b)


def assert_cells_drawn(env: VisualGridEnv, pixels: np.ndarray) -> None:
    """Each cell of the env's text grid is its tile, with the tile's centre colour in the
    middle and its background in the corner, at that cell's place in the image."""
    s = env.image_config.cell_size
    for i, row in enumerate(env.render().splitlines()):
        for j, char in enumerate(row):
            tile = env.tiles[char]
            cell = pixels[i * s : (i + 1) * s, j * s : (j + 1) * s]
            assert np.array_equal(cell, tile_pixels(tile, s)), (i, j, char)
            assert tuple(cell[s // 2, s // 2]) == tile.centre, (i, j, char)
            assert tuple(cell[0, 0]) == tile.background, (i, j, char)


def test_each_frozenlake_cell_has_its_colour_at_its_cell() -> None:
    env = VisualFrozenLake(level="P_H\n__G\n___", image_format="array")
    obs, _ = env.reset(0)
    pixels = pixels_of(obs)
    assert_cells_drawn(env, pixels)
    centre = {
        c: tuple(int(v) for v in pixels[i * 16 + 8, j * 16 + 8])
        for (i, j), c in {(0, 0): "P", (0, 1): "_", (0, 2): "H", (1, 2): "G"}.items()
    }
    assert centre == {"P": AGENT_RED, "_": ICE, "H": HOLE_BLUE, "G": GOAL_GOLD}
    obs, *_ = env.step("<answer>Right</answer>")
    assert tuple(pixels_of(obs)[8, 8]) == ICE and tuple(pixels_of(obs)[8, 24]) == AGENT_RED
    obs, *_ = env.step("<answer>Right</answer>")  # into the hole: X
    assert env.render().splitlines()[0] == "__X"
    assert_cells_drawn(env, pixels_of(obs))
    assert tuple(pixels_of(obs)[8, 40]) == AGENT_RED and tuple(pixels_of(obs)[0, 32]) == ICE
    assert tuple(pixels_of(obs)[8, 34]) == HOLE_BLUE  # the hole around you
    env.reset(0)
    env.step("<answer>Down</answer>")
    env.step("<answer>Right</answer>")
    obs, *_ = env.step("<answer>Right</answer>")  # onto the goal: W
    assert env.render().splitlines()[1] == "__W"
    assert_cells_drawn(env, pixels_of(obs))
    assert tuple(pixels_of(obs)[24, 40]) == AGENT_RED and tuple(pixels_of(obs)[24, 35]) == GOAL_GOLD


SOKOBAN_LEVEL = "#######\n#P_O_X#\n#*____#\n#######"


def test_each_sokoban_cell_has_its_colour_at_its_cell() -> None:
    env = VisualSokoban(level=SOKOBAN_LEVEL, cell_size=12, image_format="array")
    obs, _ = env.reset(0)
    assert_cells_drawn(env, pixels_of(obs))
    pixels, s = pixels_of(obs), 12

    def centre(i: int, j: int) -> tuple[int, ...]:
        return tuple(int(v) for v in pixels[i * s + s // 2, j * s + s // 2])

    assert centre(0, 0) == WALL and centre(1, 1) == PLAYER_BLUE and centre(1, 2) == FLOOR
    assert centre(1, 3) == FLOOR and tuple(pixels[1 * s + s // 2, 3 * s + 1]) != FLOOR  # ring
    assert centre(1, 5) == BOX_ORANGE and centre(2, 1) == BOX_GREEN
    env.step("<answer>Right</answer>")
    obs, *_ = env.step("<answer>Right</answer>")  # onto the target: S
    assert env.render().splitlines()[1] == "#__S_X#"
    assert_cells_drawn(env, pixels_of(obs))


# ---- the registry -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls", "text_cls"),
    [
        ("frozenlake_visual", VisualFrozenLake, FrozenLake),
        ("sokoban_visual", VisualSokoban, Sokoban),
    ],
)
def test_the_registry_builds_them(name: str, cls: type, text_cls: type) -> None:
    env = make(name, cell_size=8)
    assert isinstance(env, cls) and env.name == name and env.image_config.cell_size == 8
    assert config_keys(name) == [
        *config_keys(text_cls.__name__.lower()),
        "cell_size",
        "image_format",
    ]
    text_params = inspect.signature(text_cls).parameters
    for key, param in text_params.items():  # the same defaults as the text env's
        assert inspect.signature(cls).parameters[key].default == param.default, key
    assert is_blocking(env) is False
    with pytest.raises(EnvRegistryError, match="unknown config key"):
        make(name, cellsize=8)
    with pytest.raises(EnvRegistryError, match="cell_size"):
        check_env(name, {"cell_size": 2})


# ---- content parts ----------------------------------------------------------------

IMAGE = np.zeros((2, 3, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ("text", r"observation must be a non-empty list of content parts, got str"),
        ([], r"observation must be a non-empty list of content parts, got list"),
        (["hi"], r"observation\[0\] is str, not a dict"),
        ([{"type": "audio"}], r"observation\[0\]\['type'\] is 'audio'; a content part is"),
        ([{"text": "hi"}], r"observation\[0\]\['type'\] is None"),
        ([{"type": "text", "text": 3}], r"observation\[0\]\['text'\] must be a str, got int"),
        ([{"type": "text"}], r"observation\[0\] \(a 'text' part\) has no 'text' key"),
        (
            [{"type": "text", "text": "a"}, {"type": "image", "image": IMAGE, "detail": "low"}],
            r"observation\[1\] \(a 'image' part\) has unknown keys \['detail'\]",
        ),
        (
            [{"type": "image", "image": np.zeros((2, 3), dtype=np.uint8)}],
            r"observation\[0\]\['image'\] is a numpy array of shape \(2, 3\) and dtype uint8; "
            r"an image is a PIL.Image.Image or an H x W x 3 uint8 numpy array",
        ),
        (
            [{"type": "image", "image": np.zeros((2, 3, 4), dtype=np.uint8)}],
            r"shape \(2, 3, 4\) and dtype uint8",
        ),
        (
            [{"type": "image", "image": np.zeros((2, 3, 3), dtype=np.float32)}],
            r"shape \(2, 3, 3\) and dtype float32",
        ),
        (
            [{"type": "image", "image": np.zeros((0, 3, 3), dtype=np.uint8)}],
            r"shape \(0, 3, 3\)",
        ),
        ([{"type": "image", "image": "cat.png"}], r"\['image'\] is str 'cat.png'; an image is"),
    ],
)
def test_bad_content_parts_fail_naming_the_part(parts: Any, message: str) -> None:
    with pytest.raises(ContentError, match=message):
        check_parts(parts)


def test_a_bad_part_in_a_message_names_the_message() -> None:
    bad = [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "video"}]}]
    with pytest.raises(ContentError, match=r"observation\[1\]\['content'\]\[0\]\['type'\]"):
        image_parts(bad)
    with pytest.raises(ContentError, match=r"observation\[1\]\['content'\]\[0\]\['type'\]"):
        text_of_parts(bad)


def test_parts_images_and_log_text() -> None:
    pil = Image.new("RGB", (5, 7))
    parts = [{"type": "text", "text": "a"}, {"type": "image", "image": pil}]
    parts.append({"type": "image", "image": IMAGE})
    assert text_of_parts(parts) == "a\n<image 5x7>\n<image 3x2>"
    assert [id(im) for im in image_parts(parts)] == [id(pil), id(IMAGE)]
    messages = [{"role": "tool", "name": "cam", "content": parts}, {"role": "user", "content": "b"}]
    assert text_of_parts(messages) == "[tool cam] a\n<image 5x7>\n<image 3x2>\nb"
    assert [p["type"] for p in parts_of(messages)] == ["text", "image", "image", "text"]
    assert parts_of("plain") == [{"type": "text", "text": "plain"}] and text_of_parts("x") == "x"


@pytest.mark.parametrize(
    "module", ["rollpipe.envs.content", "rollpipe.envs.visual", "rollpipe.envs.visual_envs"]
)
def test_the_examples_run(module: str) -> None:
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    results = doctest.testmod(importlib.import_module(module), optionflags=flags)
    assert results.attempted > 0 and results.failed == 0
