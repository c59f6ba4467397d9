"""What vLLM 0.32 would silently misread raises ImageTokenError, naming the counts; the
local expansion holds for any pads and grids, and equals the processor's."""

from __future__ import annotations

import asyncio
import doctest
import importlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pictures import GREEDY, ids_of, next_turn_text, pil, random_image, render, user

from rollpipe.engines.records import EngineError
from rollpipe.vision.checks import (
    ImageTokenError,
    VisionTokens,
    check_expanded_prompt,
    check_image_prompt,
    check_reported_prompt,
    check_response,
    collapse_image_pads,
    expand_image_pads,
    image_token_counts,
    vision_tokens,
)

FIRST, SECOND = random_image(1), random_image(2, 90, 60)


@pytest.fixture(scope="module")
def turns(processor: Any) -> dict[str, Any]:
    first = [user("What is here?")]
    ids1 = ids_of(processor, render(processor, first))
    new = ids_of(processor, "<|im_end|>\n" + next_turn_text(processor, first, user("And now?")))
    tokens = vision_tokens(processor.tokenizer)
    return {"ids1": ids1, "new": new, "tokens": tokens}


def corrupt(case: str, processor: Any, turns: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """One of the requests vLLM 0.32 accepts and misreads, as (prompt ids, images)."""
    ids1, new, tokens = turns["ids1"], turns["new"], turns["tokens"]
    pad = tokens.image_pad
    two_turns = [*ids1, 77, 78, *new]  # two pads: turn 1's and turn 2's
    if case == "already expanded":
        text = render(processor, [user("What is here?")])
        return processor(text=[text], images=[pil(FIRST)], return_tensors="pt")["input_ids"][
            0
        ].tolist(), [FIRST]
    if case == "expanded, count matching":  # 2 pads in a row for 2 images
        at = ids1.index(pad)
        return [*ids1[:at], pad, *ids1[at:]], [FIRST, SECOND]
    if case == "a pad too many":
        return [*ids1, pad], [FIRST]
    if case == "pads without images":
        return ids1, []
    if case == "a later turn with only its new image":
        return two_turns, [SECOND]
    if case == "an image without a pad":
        return [i for i in ids1 if i != pad], [FIRST]
    if case == "a pad inside a response":
        return [*ids1, 77, pad, 78, *new], [FIRST, SECOND]
    if case == "a video pad":
        assert tokens.video_pad is not None
        return [*ids1, tokens.video_pad], [FIRST]
    raise AssertionError(case)


CASES = [
    ("already expanded", "4 image pad ids .* for 1 images"),
    ("expanded, count matching", "1 image pad ids follow another pad"),
    ("a pad too many", "2 image pad ids .* for 1 images"),
    ("pads without images", "1 image pad ids .* for 0 images"),
    ("a later turn with only its new image", "2 image pad ids .* for 1 images"),
    ("an image without a pad", "0 image pad ids .* for 1 images"),
    ("a pad inside a response", "3 image pad ids .* for 2 images"),
    ("a video pad", "video pad ids"),
]


@pytest.mark.parametrize(("case", "message"), CASES, ids=[c for c, _ in CASES])
def test_each_silent_corruption_raises(
    case: str, message: str, vlm_engine: Any, processor: Any, turns: dict[str, Any]
) -> None:
    """Through the real engine (which checks every request before vLLM sees it), and
    through the check itself."""
    ids, images = corrupt(case, processor, turns)
    with pytest.raises(ImageTokenError, match=message) as raised:
        asyncio.run(vlm_engine.generate(ids, GREEDY, images=images))
    assert str(raised.value).startswith("VLLMEngine request: ")
    with pytest.raises(ImageTokenError, match=f"^turn 3: .*{message}"):
        check_image_prompt(ids, len(images), turns["tokens"], "turn 3")


def test_a_vision_token_in_a_response_or_a_wrong_expansion_raises(
    vlm_engine: Any, processor: Any, turns: dict[str, Any]
) -> None:
    tokens = turns["tokens"]
    with pytest.raises(ImageTokenError, match="turn 1's response holds 1 vision token ids"):
        check_response([5, tokens.image_pad, 6], tokens, "turn 1's response")
    gen = asyncio.run(vlm_engine.generate(turns["ids1"], GREEDY, images=[FIRST]))
    check_reported_prompt(turns["ids1"], gen.prompt_token_ids, tokens)
    wrong = expand_image_pads(turns["ids1"], [[1, 6, 4]], 2, tokens.image_pad)  # SECOND's grid
    n, first = len(turns["ids1"]), turns["ids1"].index(tokens.image_pad) + 4
    message = rf"turn 1: .*\({n + 3} ids\) .* \({n + 5} ids\) from position {first} on"
    with pytest.raises(ImageTokenError, match=message):
        check_expanded_prompt(gen.prompt_token_ids, wrong, "turn 1")
    with pytest.raises(ImageTokenError, match="is not the sent prompt"):
        check_reported_prompt([*turns["ids1"], 5], gen.prompt_token_ids, tokens)


def test_engines_without_images_refuse_them_clearly() -> None:
    """A scripted engine, and HFEngine on the text tiny model: supports('images') is
    False, text works, and images raise EngineError naming what to use instead."""
    from rollpipe.engines.hf import HFEngine
    from rollpipe.engines.scripted import ScriptedEngine
    from rollpipe.training.tiny_model import default_model_path

    with ScriptedEngine(lambda prompt, params: [7]) as scripted:
        assert not scripted.supports("images")
        assert scripted.generate_batch([[1]], GREEDY)[0].token_ids == (7,)
        with pytest.raises(EngineError, match=r"^ScriptedEngine.generate\(images=...\): .*VLLM"):
            asyncio.run(scripted.generate([1, 2], GREEDY, images=[FIRST]))
    with HFEngine(default_model_path()) as hf:
        assert not hf.supports("images")
        assert hf.generate_batch([[1, 2]], GREEDY)[0].prompt_token_ids is None
        with pytest.raises(EngineError, match=r"HFEngine.generate.*reads text only"):
            asyncio.run(hf.generate([1, 2], GREEDY, images=[FIRST]))


pads = st.integers(min_value=0, max_value=6)
grids = st.tuples(
    st.just(1), st.integers(1, 8).map(lambda n: 2 * n), st.integers(1, 8).map(lambda n: 2 * n)
)


@given(
    text=st.lists(st.integers(0, 50), min_size=0, max_size=30),
    grid=st.lists(grids, min_size=0, max_size=5),
    data=st.data(),
)
def test_expansion_holds_for_any_pads_and_grids(
    text: list[int], grid: list[Any], data: Any
) -> None:
    """Pads anywhere (never two in a row): each becomes its image's t*h*w/4 pads, the text
    between stays, collapsing gives the prompt back, and the reported check passes."""
    pad = 99
    assume(len(grid) <= len(text) + 1)
    slots = st.lists(st.integers(0, len(text)), min_size=len(grid), max_size=len(grid), unique=True)
    ids = list(text)
    for slot in sorted(data.draw(slots), reverse=True):  # one pad per image, text between
        ids.insert(slot, pad)
    counts = image_token_counts(grid, 2)
    out = expand_image_pads(ids, grid, 2, pad)
    assert len(out) == len(ids) - len(grid) + sum(counts)
    assert [i for i in out if i != pad] == text
    assert collapse_image_pads(out, pad) == ids
    runs = np.diff(np.flatnonzero(np.diff(np.r_[0, np.asarray(out) == pad, 0])))[::2]
    assert runs.tolist() == [c for c in counts if c]
    check_reported_prompt(ids, out, VisionTokens(image_pad=pad))


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.tuples(st.integers(20, 200), st.integers(20, 200)), min_size=1, max_size=3),
    words=st.lists(st.sampled_from(["go", "left", "box", "the", "?"]), min_size=1, max_size=4),
)
def test_the_local_expansion_equals_the_processors(
    processor: Any, sizes: list[tuple[int, int]], words: list[str]
) -> None:
    """Any image sizes: expanding the one-pad-per-image ids with the image processor's
    grids gives the processor's own ids for the same text and images."""
    images = [random_image(h * 1000 + w, h, w) for h, w in sizes]
    text = render(processor, [user(" ".join(words), images=len(images))])
    want = processor(text=[text], images=[pil(i) for i in images], return_tensors="pt")
    grid = want["image_grid_thw"]
    pad = vision_tokens(processor.tokenizer).image_pad
    ours = expand_image_pads(
        ids_of(processor, text), grid, processor.image_processor.merge_size, pad
    )
    assert ours == want["input_ids"][0].tolist()


@pytest.mark.parametrize(
    "module", ["rollpipe.engines.images", "rollpipe.vision.checks", "rollpipe.training.tiny_vlm"]
)
def test_the_examples_run(module: str) -> None:
    mod = importlib.import_module(module)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    failed, tried = doctest.testmod(mod, optionflags=flags, report=True)
    assert tried and not failed
