"""Image rows in verl's and ROLL's layouts: multi_modal_inputs per row, and Qwen-VL's
positions ([B, 4, L]: text, then the model's own get_rope_index axes) once the batch
carries mrope_position_ids (rollpipe.vision.rows.with_mrope_positions)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec
from rollpipe.data.roll_layout import roll_parts
from rollpipe.data.rows import step_rows, trajectory_rows
from rollpipe.data.verl_layout import verl_parts
from rollpipe.envs.visual_envs import VisualFrozenLake
from rollpipe.vision.rows import mrope_position_ids, with_mrope_positions

SETTINGS = EpisodeSettings(
    max_turns=2, max_length=1536, sampling={"max_tokens": 10, "temperature": 1.0}
)


@pytest.fixture(scope="module")
def image_trajectories(vlm_engine: Any, vlm_path: Any) -> list[Any]:
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_path))
    chat = SETTINGS.chat_format(tokenizer)
    out = []
    for seed in (1, 2, 3):
        spec = EpisodeSpec(group_id=seed, episode_id=seed, seed=seed, env_name="frozenlake_visual")
        out.append(
            vlm_engine.runtime.call(
                run_episode(spec, VisualFrozenLake(), vlm_engine, chat, SETTINGS)
            )
        )
    return out


@pytest.mark.parametrize("level", ["trajectory", "step"])
def test_verl_rows_carry_features_and_4d_positions(image_trajectories, hf_vlm, level):
    build = trajectory_rows if level == "trajectory" else step_rows
    rows = with_mrope_positions(build(image_trajectories, pad_token_id=0), hf_vlm)
    native = mrope_position_ids(rows, hf_vlm, hf_vlm.config.image_token_id)
    assert torch.equal(rows.batch["mrope_position_ids"], native.transpose(1, 2))
    tensors, columns, _ = verl_parts(rows)
    positions, mask = tensors["position_ids"], tensors["attention_mask"].bool()
    assert positions.shape == (len(rows), 4, tensors["input_ids"].shape[1])
    native_mask = rows.batch["attention_mask"].bool()
    for i in range(len(rows)):
        # each row's real tokens keep their positions, in order; padding is 1, as verl's
        assert torch.equal(positions[i, 1:, mask[i]], native[i][:, native_mask[i]])
        assert torch.equal(positions[i, 0, mask[i]], torch.arange(int(mask[i].sum())))
        assert (positions[i][:, ~mask[i]] == 1).all()
        mm, grid = columns["multi_modal_inputs"][i], rows.non_tensor_batch["multi_modal_inputs"][i]
        assert torch.equal(mm["pixel_values"], grid["pixel_values"])
        thw = grid["image_grid_thw"]
        assert torch.equal(
            mm["images_seqlens"], (thw[:, 1] * thw[:, 2]).repeat_interleave(thw[:, 0])
        )
    assert "mrope_position_ids" not in tensors


def test_verl_rows_without_rope_positions_keep_text_positions(image_trajectories):
    rows = trajectory_rows(image_trajectories, pad_token_id=0)
    tensors, columns, _ = verl_parts(rows)
    assert tensors["position_ids"].dim() == 2  # a model without get_rope_index (LLaVA)
    assert "images_seqlens" in columns["multi_modal_inputs"][0]


@pytest.mark.parametrize("level", ["trajectory", "step"])
def test_roll_rows_carry_features_and_4d_positions(image_trajectories, hf_vlm, level):
    build = trajectory_rows if level == "trajectory" else step_rows
    rows = with_mrope_positions(build(image_trajectories, pad_token_id=0), hf_vlm)
    width = rows.batch["input_ids"].shape[1] + 5
    tensors, columns, _ = roll_parts(rows, sequence_length=width, pad_token_id=0)
    positions, mask = tensors["position_ids"], tensors["attention_mask"].bool()
    assert positions.shape == (len(rows), 4, width)
    native = rows.batch["mrope_position_ids"]
    native_mask = rows.batch["attention_mask"].bool()
    for i in range(len(rows)):
        n = int(mask[i].sum())
        assert torch.equal(positions[i, 1:, :n], native[i][native_mask[i]].T)
        assert torch.equal(positions[i, 0, :n], torch.arange(n))
        assert (positions[i, :, n:] == 0).all()  # ROLL pads positions with 0
        mm = columns["multi_modal_inputs"][i]
        assert set(mm) == {"pixel_values", "image_grid_thw"}  # ROLL's collator's names
        assert torch.equal(
            mm["pixel_values"], rows.non_tensor_batch["multi_modal_inputs"][i]["pixel_values"]
        )
    assert "mrope_position_ids" not in tensors


def test_text_rows_keep_their_layouts(image_trajectories):
    from rollpipe.agent.records import Trajectory, Turn

    plain = [
        Trajectory(
            t.spec,
            t.env_id,
            [Turn.from_state({**u.to_state()}) for u in t.turns][:0]
            or [Turn([1, 2], [3], [-0.5], [0], 1.0, "stop", True, "Up", "o")],
            1.0,
            True,
            "terminated",
        )
        for t in image_trajectories
    ]
    rows = trajectory_rows(plain, pad_token_id=0)
    assert "multi_modal_inputs" not in verl_parts(rows)[1]
    assert "multi_modal_inputs" not in roll_parts(rows)[1]
    assert roll_parts(rows)[0]["position_ids"].dim() == 2
