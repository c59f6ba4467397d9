"""Checkpoints keep image features: an image trajectory's state (plain data and tensors,
through torch.save / torch.load(weights_only=True)) gives back ImageTurns with their
pixel_values and grids bitwise; a pipeline checkpointed between batches of Visual
FrozenLake resumes with nothing lost; and a visual env needs no ``import rollpipe.vision``
by hand."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import torch
from transformers import AutoTokenizer

from rollpipe.agent.episode import EpisodeSettings, run_episode
from rollpipe.agent.records import EpisodeSpec, Group, Trajectory, Turn
from rollpipe.config import PipelineConfig
from rollpipe.envs.visual_envs import VisualFrozenLake
from rollpipe.pipeline import RolloutPipeline
from rollpipe.vision.conversation import ImageTurn

SETTINGS = EpisodeSettings(
    max_turns=3, max_length=1536, sampling={"max_tokens": 12, "temperature": 1.0}
)


def plain_round_trip(state: Any) -> Any:
    """``state`` through torch.save / torch.load(weights_only=True), after checking it is
    JSON apart from tensors (what every rollpipe checkpoint is)."""

    def tensors_only(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.tolist()
        raise TypeError(f"state holds a {type(obj).__name__}: {obj!r}")

    json.dumps(state, default=tensors_only)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same_features(a: Turn, b: Turn) -> bool:
    assert type(a) is type(b)
    for name in ("pixel_values", "image_grid_thw"):
        x, y = getattr(a, name, None), getattr(b, name, None)
        if (x is None) != (y is None):
            return False
        if x is not None and not (x.dtype == y.dtype and torch.equal(x, y)):
            return False
    return True


def episode(vlm_engine: Any, tokenizer: Any, seed: int) -> Trajectory:
    spec = EpisodeSpec(group_id=0, episode_id=seed, seed=seed, env_name="frozenlake_visual")
    chat = SETTINGS.chat_format(tokenizer)
    return vlm_engine.runtime.call(
        run_episode(spec, VisualFrozenLake(), vlm_engine, chat, SETTINGS)
    )


def test_an_image_trajectory_round_trips_through_its_state(vlm_engine: Any, vlm_path: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_path))
    trajs = [episode(vlm_engine, tokenizer, seed) for seed in (5, 6)]
    assert all(isinstance(u, ImageTurn) for t in trajs for u in t.turns)
    assert trajs[0].turns[0].pixel_values is not None
    group = Group(0, trajs)
    back = Group.from_state(plain_round_trip(group.to_state()))
    assert back == group
    for t, b in zip(group.trajectories, back.trajectories, strict=True):
        assert all(same_features(u, v) for u, v in zip(t.turns, b.turns, strict=True))
        assert [v.num_images for v in b.turns] == [u.num_images for u in t.turns]


def test_a_text_turns_state_is_unchanged() -> None:
    turn = Turn([1, 2], [3], [-0.5], [0], 1.0, "stop", True, "Up", "Move?")
    state = turn.to_state()
    assert "turn_type" not in state and "turn_fields" not in state
    assert type(Turn.from_state(state)) is Turn


def test_an_image_turn_without_images_round_trips() -> None:
    turn = ImageTurn([1, 2], [3], [-0.5], [0], 1.0, "stop", True, "Up", "Move?")
    back = Turn.from_state(plain_round_trip(turn.to_state()))
    assert type(back) is ImageTurn and back == turn and back.pixel_values is None


def batch_contents(batch: Any) -> list[Any]:
    """Per row: traj uid, real ids, and its image features (bytes): what must not change."""
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    out = []
    for i in range(len(batch)):
        mm = batch.non_tensor_batch["multi_modal_inputs"][i]
        out.append(
            (
                batch.non_tensor_batch["traj_uid"][i],
                tuple(ids[i][mask[i]].tolist()),
                mm["pixel_values"].numpy().tobytes(),
                tuple(mm["image_grid_thw"].flatten().tolist()),
            )
        )
    return out


def test_a_pipeline_checkpoint_of_image_episodes_loses_nothing(
    vlm_engine: Any, vlm_path: Any
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(vlm_path))
    config = PipelineConfig(
        envs="frozenlake_visual",
        group_size=2,
        batch_size=2,
        num_groups=3,
        max_turns=2,
        max_length=1024,
        concurrency=4,
        seed=11,
        sampling={"max_tokens": 8, "temperature": 1.0},
    )
    with RolloutPipeline(config, vlm_engine, tokenizer) as pipe:
        uninterrupted = [batch_contents(b) for b in pipe]
    assert len(uninterrupted) == 3
    with RolloutPipeline(config, vlm_engine, tokenizer) as pipe:
        first = batch_contents(pipe.get_batch())
        state = plain_round_trip(pipe.state_dict())
    with RolloutPipeline(config, vlm_engine, tokenizer) as restored:
        restored.load_state_dict(state)
        rest = [batch_contents(b) for b in restored]
    assert [first, *rest] == uninterrupted


def test_a_visual_env_registers_the_image_conversation_itself() -> None:
    """A fresh interpreter: making frozenlake_visual is enough for the episode to find the
    image conversation (no ``import rollpipe.vision`` by hand)."""
    code = (
        "import sys\n"
        "from rollpipe.envs.registry import make\n"
        "assert 'rollpipe.vision.conversation' not in sys.modules\n"
        "make('frozenlake_visual')\n"
        "assert 'rollpipe.vision.conversation' in sys.modules, 'not registered'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
