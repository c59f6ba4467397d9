"""The image turn path on the real vLLM engine with the tiny VLM: a Visual FrozenLake
episode (and a batch through RolloutPipeline) gives ImageTurns whose rows hold the
expanded ids the engine saw, with per-row multi_modal_inputs; an HF forward on a
multi-turn row (its pixel_values and image_grid_thw, our 3-D positions) reproduces the
engine's logprobs; a conversation whose engine reports another expansion fails naming
the turn."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import rollpipe.vision.conversation as image_conversation
from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec
from rollpipe.config import PipelineConfig
from rollpipe.data.rows import step_rows, trajectory_rows
from rollpipe.data.verl_layout import verl_parts
from rollpipe.engines.images import ImageTokenError, image_token_counts
from rollpipe.engines.records import Generation
from rollpipe.envs.visual_envs import VisualFrozenLake
from rollpipe.pipeline import RolloutPipeline
from rollpipe.vision.checks import vision_tokens
from rollpipe.vision.rows import mm_token_type_ids, mrope_position_ids

SETTINGS = EpisodeSettings(
    max_turns=3, max_length=1536, sampling={"max_tokens": 12, "temperature": 1.0}
)


@pytest.fixture(scope="module")
def vlm_tokenizer(vlm_path: Any) -> Any:
    return AutoTokenizer.from_pretrained(str(vlm_path))


@pytest.fixture(scope="module")
def lake_episode(vlm_engine: Any, vlm_tokenizer: Any) -> Any:
    spec = EpisodeSpec(group_id=0, episode_id=0, seed=5, env_name="frozenlake_visual")
    chat = SETTINGS.chat_format(vlm_tokenizer)
    return vlm_engine.runtime.call(
        run_episode(spec, VisualFrozenLake(), vlm_engine, chat, SETTINGS)
    )


def test_a_visual_frozenlake_episode_records_image_turns(lake_episode: Any, processor: Any) -> None:
    traj = lake_episode
    assert traj.error is None and traj.num_turns >= 1
    assert all(isinstance(u, image_conversation.ImageTurn) for u in traj.turns)
    pad = vision_tokens(processor.tokenizer).image_pad
    merge = processor.image_processor.merge_size
    for u in traj.turns:
        assert u.num_images == 1  # each observation shows the grid once
        (count,) = image_token_counts(u.image_grid_thw, merge)
        assert list(u.prompt_ids).count(pad) == count  # expanded: what the model saw
        assert pad not in u.response_ids
        assert u.pixel_values.shape[0] == int(u.image_grid_thw.prod())
        assert "<image " in u.observation  # the log text shows the image's size


def test_rows_carry_the_rows_images_as_verl_reads_them(lake_episode: Any, processor: Any) -> None:
    traj = lake_episode
    rows = trajectory_rows([traj], pad_token_id=0)
    inputs = rows.non_tensor_batch["multi_modal_inputs"]
    assert inputs.dtype == object and inputs.shape == (1,)
    (mm,) = inputs
    assert torch.equal(mm["pixel_values"], torch.cat([u.pixel_values for u in traj.turns]))
    assert torch.equal(mm["image_grid_thw"], torch.cat([u.image_grid_thw for u in traj.turns]))
    ids = rows.batch["input_ids"][0].tolist()
    assert ids == [i for u in traj.turns for i in (*u.prompt_ids, *u.response_ids)]
    _, columns, _ = verl_parts(rows)
    verl_mm = columns["multi_modal_inputs"][0]  # verl's non_tensor_batch column
    assert all(verl_mm[k] is v for k, v in mm.items()) and "images_seqlens" in verl_mm


def test_step_rows_carry_the_images_of_their_row_so_far(lake_episode: Any) -> None:
    traj = lake_episode
    rows = step_rows([traj], pad_token_id=0)
    inputs = rows.non_tensor_batch["multi_modal_inputs"]
    assert len(inputs) == traj.num_turns
    for i, mm in enumerate(inputs):
        turns = traj.turns[: i + 1]
        assert torch.equal(mm["pixel_values"], torch.cat([u.pixel_values for u in turns]))
        assert mm["image_grid_thw"].shape == (i + 1, 3)


def test_text_rows_have_no_image_column(vlm_engine: Any) -> None:
    from rollpipe.agent.records import Trajectory, Turn

    done = dict(finish_reason="stop", action_valid=True, action_text="", observation="o")
    turn = Turn([1, 2], [3], [-0.5], [0], 1.0, **done)
    traj = Trajectory(
        EpisodeSpec(0, 0, 0),
        env_id=0,
        turns=[turn],
        score=1.0,
        success=True,
        end_reason="terminated",
    )
    assert "multi_modal_inputs" not in trajectory_rows([traj], 0).non_tensor_batch
    assert "multi_modal_inputs" not in step_rows([traj], 0).non_tensor_batch


def test_an_hf_forward_on_the_row_reproduces_the_engines_logprobs(
    lake_episode: Any, hf_vlm: Any, processor: Any
) -> None:
    """The whole multi-turn row in one forward, with the row's pixel_values and grids and
    the 3-D positions from mrope_position_ids: the engine's logprobs within 1e-4."""
    traj = lake_episode
    rows = trajectory_rows([traj], pad_token_id=0)
    pad = vision_tokens(processor.tokenizer).image_pad
    ids, mask = rows.batch["input_ids"], rows.batch["attention_mask"]
    (mm,) = rows.non_tensor_batch["multi_modal_inputs"]
    positions = mrope_position_ids(rows, hf_vlm, pad)
    assert positions.shape == (1, 3, ids.shape[1])
    with torch.no_grad():
        logits = hf_vlm(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions.transpose(0, 1),  # transformers' (3, B, L)
            pixel_values=mm["pixel_values"],
            image_grid_thw=mm["image_grid_thw"],
            mm_token_type_ids=mm_token_type_ids(ids, pad),
        ).logits[0]
    every = torch.log_softmax(logits[:-1].float(), -1)
    picked = every.gather(-1, ids[0, 1:, None])[:, 0]
    response = rows.batch["response_mask"][0, 1:]
    ours = picked[response].numpy()
    engine = rows.batch["infer_logprobs"][0, 1:][response].numpy()
    assert len(ours) == sum(len(u.response_ids) for u in traj.turns)
    assert np.abs(ours - engine).max() < 1e-4


def test_a_batch_through_the_pipeline(vlm_engine: Any, vlm_tokenizer: Any) -> None:
    config = PipelineConfig(
        envs="frozenlake_visual",
        group_size=2,
        batch_size=4,
        num_groups=2,
        max_turns=2,
        max_length=1024,
        concurrency=4,
        seed=3,
        sampling={"max_tokens": 8, "temperature": 1.0},
    )
    with RolloutPipeline(config, vlm_engine, vlm_tokenizer) as pipe:
        batches = list(pipe)
    assert [len(b) for b in batches] == [4]
    (batch,) = batches
    pad = vision_tokens(vlm_tokenizer).image_pad
    inputs = batch.non_tensor_batch["multi_modal_inputs"]
    assert len(inputs) == 4
    for i, mm in enumerate(inputs):
        grids = mm["image_grid_thw"]
        assert mm["pixel_values"].shape[0] == int(grids.prod(-1).sum())
        row = batch.batch["input_ids"][i][batch.batch["attention_mask"][i].bool()]
        assert int((row == pad).sum()) == sum(image_token_counts(grids, 2))


class _MisreadingEngine:
    """Reports an expanded prompt one pad short: what vLLM does with a wrong pad count."""

    def __init__(self, pad: int) -> None:
        self.pad = pad

    async def generate(
        self, prompt_ids: Any, params: Any, *, on_tokens: Any = None, images: Any = ()
    ) -> Generation:
        return Generation([5], [-0.1], "stop", [0], prompt_token_ids=[*prompt_ids, self.pad])


def test_an_engine_that_misreads_the_images_fails_naming_the_turn(
    vlm_tokenizer: Any,
) -> None:
    pad = vision_tokens(vlm_tokenizer).image_pad
    spec = EpisodeSpec(group_id=0, episode_id=0, seed=5)
    chat = SETTINGS.chat_format(vlm_tokenizer)
    episode = run_episode(spec, VisualFrozenLake(), _MisreadingEngine(pad), chat, SETTINGS)  # type: ignore[arg-type]
    with pytest.raises(
        ImageTokenError, match=r"turn 0: the engine's expanded prompt .* image pads"
    ):
        asyncio.run(episode)
