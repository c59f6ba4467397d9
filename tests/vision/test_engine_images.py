"""Images through the engines: vLLM expands one pad per image as transformers' processor
does, reports it, and its logprobs are the HF model's on the expanded row; HFEngine and
an EnginePool of them give the same tokens, prompt and logprobs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pictures import (
    GREEDY,
    expanded_by_processor,
    ids_of,
    next_turn_text,
    random_image,
    render,
    user,
)

from rollpipe.engines.hf import HFEngine
from rollpipe.engines.pool import EnginePool
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.vision.checks import (
    check_expanded_prompt,
    expand_image_pads,
    vision_token_ids,
    vision_tokens,
)

FIRST, SECOND = random_image(1), random_image(2, 90, 60)


def generate(engine: Any, ids: list[int], images: list[np.ndarray], params: Any = GREEDY) -> Any:
    return asyncio.run(engine.generate(ids, params, images=images))


@pytest.fixture(scope="module")
def two_turns(vlm_engine: Any, processor: Any) -> dict[str, Any]:
    """A 2-turn image conversation, token in: turn 2's prompt is turn 1's (unexpanded)
    prompt, its response ids and the new turn's ids (one more image)."""
    first = [user("What is here?")]
    ids1 = ids_of(processor, render(processor, first))
    gen1 = generate(vlm_engine, ids1, [FIRST])
    new = next_turn_text(processor, first, user("And now?"))
    ids2 = [*ids1, *gen1.token_ids, *ids_of(processor, "<|im_end|>\n" + new)]
    gen2 = generate(vlm_engine, ids2, [FIRST, SECOND])
    return {"first": first, "ids1": ids1, "gen1": gen1, "ids2": ids2, "gen2": gen2}


def local_expansion(processor: Any, ids: list[int], images: list[np.ndarray]) -> list[int]:
    grid = processor.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
    pad = vision_tokens(processor.tokenizer).image_pad
    return expand_image_pads(ids, grid, processor.image_processor.merge_size, pad)


def test_the_engine_reports_the_processors_expansion(
    vlm_engine: Any, processor: Any, two_turns: dict[str, Any]
) -> None:
    """Turn 1: vLLM's expanded prompt is the processor's. Turn 2 (token in, two images):
    it is the local expansion of the unexpanded ids; and the whole conversation rendered
    as text and sent with both images expands exactly as the processor expands it."""
    assert vlm_engine.supports("images")
    text1 = render(processor, two_turns["first"])
    gen1 = two_turns["gen1"]
    assert list(gen1.prompt_token_ids) == expanded_by_processor(processor, text1, [FIRST])
    assert len(gen1.prompt_token_ids) == len(two_turns["ids1"]) - 1 + 4  # 64x64: 4 tokens
    expected = local_expansion(processor, two_turns["ids2"], [FIRST, SECOND])
    check_expanded_prompt(two_turns["gen2"].prompt_token_ids, expected, "turn 2")
    reply = processor.tokenizer.decode(gen1.token_ids)
    whole = [*two_turns["first"], {"role": "assistant", "content": reply}, user("And now?")]
    text2 = render(processor, whole)
    gen = generate(vlm_engine, ids_of(processor, text2), [FIRST, SECOND])
    assert list(gen.prompt_token_ids) == expanded_by_processor(processor, text2, [FIRST, SECOND])


def hf_logprobs(model: Any, processor: Any, gen: Generation, images: list[np.ndarray]) -> Any:
    """The HF model's logprobs of ``gen``'s tokens on the expanded row (its prompt as the
    engine reported it, then its response), with the row's pixel_values and grids."""
    row = torch.tensor([[*gen.prompt_token_ids, *gen.token_ids]])
    features = processor.image_processor(images=images, return_tensors="pt")
    pad = vision_tokens(processor.tokenizer).image_pad
    with torch.no_grad():
        logits = model(
            input_ids=row,
            attention_mask=torch.ones_like(row),
            pixel_values=features["pixel_values"],
            image_grid_thw=features["image_grid_thw"],
            mm_token_type_ids=(row == pad).int(),  # transformers 5's get_rope_index needs it
        ).logits[0]
    start = len(gen.prompt_token_ids)
    every = torch.log_softmax(logits[start - 1 : -1].float(), -1)
    return every.gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0].numpy()


def test_hf_forward_on_the_expanded_row_reproduces_the_engines_logprobs(
    hf_vlm: Any, processor: Any, two_turns: dict[str, Any]
) -> None:
    for gen, images in ((two_turns["gen1"], [FIRST]), (two_turns["gen2"], [FIRST, SECOND])):
        ours = hf_logprobs(hf_vlm, processor, gen, images)
        assert np.abs(ours - np.array(gen.logprobs)).max() < 1e-4


def test_hf_engine_and_a_pool_of_them_match_vllm(
    vlm_path: Path, processor: Any, two_turns: dict[str, Any]
) -> None:
    """The same 2-image turn through HFEngine, and through an EnginePool of two HFEngines
    (images reach the rank's engine): same tokens, same expanded prompt, logprobs within
    1e-4 of vLLM's."""
    want = two_turns["gen2"]
    with EnginePool(lambda rank: HFEngine(vlm_path), 2) as pool:
        assert pool.supports("images")
        gens = [generate(pool.engine(0), two_turns["ids2"], [FIRST, SECOND])]
        gens.append(generate(pool, two_turns["ids2"], [FIRST, SECOND]))
        text = pool.generate_batch([two_turns["ids1"][:5]], GREEDY)[0]  # text still works
    assert text.prompt_token_ids is None and text.num_tokens == GREEDY.max_tokens
    for gen in gens:
        assert gen.token_ids == want.token_ids
        assert gen.prompt_token_ids == want.prompt_token_ids
        assert np.abs(np.array(gen.logprobs) - np.array(want.logprobs)).max() < 1e-4


def test_vision_tokens_are_never_sampled(vlm_engine: Any, processor: Any) -> None:
    """The random model ranks a vision token first in some of these responses (its raw
    top-1: vLLM's logprobs are the model's own), yet none is sampled, greedy or at
    temperature 1.5, with images or without."""
    banned = set(vision_token_ids(processor.tokenizer))
    ids = ids_of(processor, render(processor, [user("What is here?")]))
    probe = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, top_logprobs=1)
    hot = SamplingParams(max_tokens=64, temperature=1.5, ignore_eos=True)

    async def many() -> tuple[list[Generation], list[Generation]]:
        greedy = [vlm_engine.generate(ids, probe, images=[random_image(s)]) for s in range(8)]
        sampled = [
            vlm_engine.generate(ids, hot.replace(seed=s), images=[random_image(s)])
            for s in range(8)
        ]
        text = [vlm_engine.generate(ids[:6], hot.replace(seed=s)) for s in range(8)]
        first = list(await asyncio.gather(*greedy))
        return first, list(await asyncio.gather(*sampled, *text))

    greedy, sampled = asyncio.run(many())
    tops = [top[0][0] for gen in greedy for top in gen.top_logprobs]
    assert banned & set(tops)  # the model wants them: the ban is what stops it
    for gen in greedy + sampled:
        assert not banned & set(gen.token_ids)
