"""A native rollpipe batch in ROLL's agentic layout, field for field.

ROLL's env managers build one ``DataProto`` per episode (``TrajEnvManager.
formulate_rollouts``: one row per trajectory; ``StepEnvManager.formulate_rollouts``: one
row per step, for GiGPO) and its ``RolloutScheduler.get_batch`` concatenates them. The
trainer side (``compute_discounted_returns``, GiGPO's state grouping, reward
normalisation, ``agentic_compute_advantage``, the actor's loss) reads that layout. Native
rows already share most of it (``rollpipe.data.rows``); :func:`to_roll` converts the rest,
so a ROLL trainer can take rollpipe's batches unchanged.
"""

from __future__ import annotations

import hashlib
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from rollpipe.data.proto.columns import object_array
from rollpipe.data.realign import (
    NativeBatch,
    Place,
    columns_of,
    pad_id_of,
    per_token,
    require,
    right_aligned,
)

__all__ = [
    "ROLL_STEP_COLUMNS",
    "ROLL_TENSORS",
    "ROLL_TRAJECTORY_COLUMNS",
    "native_infer_logprobs",
    "roll_parts",
    "roll_state_hash",
    "to_roll",
]

_B = TypeVar("_B", bound=NativeBatch)

ROLL_TENSORS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "prompt_mask",
    "scores",
    "infer_logprobs",
)
"""The tensors of a ROLL agentic batch (``infer_logprobs`` is ``[B, L - 1]``)."""
ROLL_TRAJECTORY_COLUMNS = (
    "env_ids",
    "group_ids",
    "tags",
    "step_scores",
    "episode_scores",
    "traj_group_id",
    "traj_id",
)
"""Its object columns for trajectory rows (``TrajEnvManager``)."""
ROLL_STEP_COLUMNS = (*ROLL_TRAJECTORY_COLUMNS, "state_hash", "step")
"""Its object columns for step rows (``StepEnvManager``)."""

_NATIVE_TENSORS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "prompt_mask",
    "scores",
    "infer_logprobs",
    "traj_group_id",
    "traj_id",
    "env_ids",
    "episode_scores",
)
_NATIVE_COLUMNS = ("step_scores", "tags")
# native columns that become a ROLL column (or are rebuilt), so never kept as extras
_CONSUMED = {
    *_NATIVE_TENSORS,
    *_NATIVE_COLUMNS,
    "position_ids",
    "step",
    "state_hash",
    "observations",
    "mrope_position_ids",
    "multi_modal_inputs",
}
_MROPE = "mrope_position_ids"  # rollpipe.vision.rows.with_mrope_positions: [B, L, 3]
_PER_TOKEN_FILL = {"policy_versions": -1}


def roll_state_hash(observation: str) -> str:
    """ROLL's ``state_hash`` of an observation text: the sha256 hex digest its
    ``compute_object_hash`` gives a ``str`` (the bytes ``b"str:"`` + UTF-8 text)."""
    return hashlib.sha256(b"str:" + observation.encode("utf-8")).hexdigest()


def to_roll(
    batch: _B,
    *,
    sequence_length: int | None = None,
    pad_token_id: int | None = None,
    extras: bool = False,
) -> _B:
    """``batch`` (native rows) as ROLL's env managers and ``get_batch`` would hand it over.

    Trajectory rows become ``TrajEnvManager`` rows, step rows (``level="step"``) become
    ``StepEnvManager`` rows. Tensors: ``input_ids``, ``attention_mask``, ``position_ids``
    (int64), ``response_mask``, ``prompt_mask`` (bool), ``scores`` (float32), all
    ``[B, L]`` right-padded, and ``infer_logprobs`` (float32 ``[B, L - 1]``: ROLL stores
    the per-token engine logprobs shifted, ``[:, 1:]``, aligned with its ``[:, 1:]``
    masks). Object columns, one Python value per row: ``env_ids``, ``group_ids`` (int),
    ``tags`` (str), ``episode_scores`` (float), ``traj_group_id`` / ``traj_id`` (str),
    ``step_scores`` (trajectory rows: a 1-D object array of the turn rewards, what
    ROLL's ``DataProto.concat`` makes of its per-episode lists; step rows: the turn's
    reward); step rows add ``step`` (int) and ``state_hash`` (str, sha256 hex of the
    observation, see :func:`roll_state_hash`). ``meta_info`` is kept as it is.

    ``sequence_length`` pads every row to ROLL's fixed width (default: the native width);
    ``pad_token_id`` is the id padding is written with (default: the one found in the
    batch; needed only when the batch has no padding yet must be padded). With
    ``extras=True`` the native columns ROLL has no field for (``policy_versions``,
    ``uid``, ``traj_uid``, ``end_reasons``, ``observations``, your own) are kept, per-token
    ones re-aligned like ``input_ids``.

    Differences that remain, each because the native batch does not carry ROLL's value:

    * ``group_ids``: ROLL's is the env group (a fixed set of env managers that plays one
      group after another), so it repeats across GRPO groups; rollpipe runs each group
      once, so it is the group id, unique per GRPO group (``traj_group_id`` is ROLL's
      per-group key either way).
    * ``traj_group_id`` is ``f"{tag}_{group_id}"`` and ``traj_id`` is
      ``f"{traj_group_id}_{episode_id}"``. ROLL formats ``{tag}_{env_group}_{episode}_
      {group_seed}`` and appends the env manager's id, which is unique within a group;
      rollpipe's ``env_ids`` are pooled env instances that one group may reuse, so the
      episode id takes its place. ROLL only compares these strings (``group_by``), and
      the grouping is the same: one ``traj_group_id`` per group, one ``traj_id`` per
      trajectory, shared by its step rows.
    * ``episode_scores`` of step rows are the native float32 value widened to a Python
      float (trajectory rows sum their ``step_scores``, exactly as ROLL sums rewards).
    * ``state_hash`` needs the turn's observation text, which step rows carry only when
      they have a non-tensor ``observations`` column (one string per row: the
      observation the turn answered); without it this raises KeyError naming it.
    * The width is the native batch's (its longest row, maybe rounded up) unless
      ``sequence_length`` is given; ROLL always pads to its ``sequence_length``, so pass
      it to concatenate batches of different calls.
    * ``meta_info["metrics"]`` are rollpipe's batch metrics (floats); ROLL's
      ``get_batch`` gathers each episode's env metrics into lists.
    * Image rows (``rollpipe.vision``) carry ``multi_modal_inputs`` (one dict per row:
      ``pixel_values``, ``image_grid_thw``; ``{}`` without images), the column ROLL's
      ``DataCollatorWithPaddingForMM`` fills and ``VLTrajEnvManager`` keeps; with
      ``mrope_position_ids`` (``rollpipe.vision.rows.with_mrope_positions``)
      ``position_ids`` is ``[B, 4, L]`` (text positions, then the three rope axes; 0 on
      padding). ROLL's ``messages_list`` (the chat messages) and ``multi_modal_data``
      (the raw images for its vLLM, absent from its final rollouts too) are not given:
      the rows hold the ids and features the model saw.

    Examples:
        >>> from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
        >>> from rollpipe.data.rows import trajectory_rows
        >>> turn = Turn(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.5, -0.5],
        ...             versions=[0, 0], reward=1.0, finish_reason="stop",
        ...             action_valid=True, action_text="", observation="o")
        >>> traj = Trajectory(EpisodeSpec(group_id=0, episode_id=0, seed=0), env_id=0,
        ...                   turns=[turn], score=1.0, success=True, end_reason="terminated")
        >>> rows = trajectory_rows([traj], pad_token_id=0)
        >>> roll = to_roll(rows, sequence_length=6, pad_token_id=0)  # ROLL's fixed width
        >>> roll["input_ids"], roll["infer_logprobs"]  # padded to 6; logprobs shifted by one
        (tensor([[1, 2, 3, 4, 0, 0]]), tensor([[ 0.0000, -0.5000, -0.5000,  0.0000,  0.0000]]))
        >>> roll["traj_group_id"], roll["traj_id"], roll["episode_scores"]
        (array(['frozenlake_0'], dtype=object), array(['frozenlake_0_0'], dtype=object),
         array([1.0], dtype=object))
    """
    tensors, columns, meta = roll_parts(
        batch, sequence_length=sequence_length, pad_token_id=pad_token_id, extras=extras
    )
    return type(batch).from_dict(tensors=tensors, non_tensors=columns, meta_info=meta)


def roll_parts(
    batch: NativeBatch,
    *,
    sequence_length: int | None = None,
    pad_token_id: int | None = None,
    extras: bool = False,
) -> tuple[dict[str, Tensor], dict[str, np.ndarray], dict[str, Any]]:
    """:func:`to_roll`'s tensors, object columns and ``meta_info`` as plain dicts."""
    tensors, columns = columns_of(batch)
    require([*tensors, *columns], [*_NATIVE_TENSORS, *_NATIVE_COLUMNS], "to_roll")
    step_level = "step" in tensors
    if step_level and "observations" not in columns:
        raise KeyError(
            "to_roll of step rows needs a non-tensor 'observations' column (one str per row: "
            "the observation the turn answered, Turn.observation) for ROLL's state_hash, the "
            "sha256 of that text; the native int64 state_hash cannot be turned into it"
        )
    attention = tensors["attention_mask"]
    rows, native_width = attention.shape
    width = native_width if sequence_length is None else int(sequence_length)
    place = right_aligned(attention, width)
    pad_id = pad_id_of(tensors["input_ids"], attention, pad_token_id)
    if pad_id is None and not bool(place.valid.all()):
        raise ValueError(
            "to_roll: the batch has no padding to read the pad id from, but its rows must "
            f"be padded to {width} columns; pass pad_token_id"
        )
    mask = place.take(attention, 0)
    out = {
        "input_ids": place.take(tensors["input_ids"], pad_id if pad_id is not None else 0),
        "attention_mask": mask,
        "position_ids": _position_ids(mask, tensors.get(_MROPE), place),
        "response_mask": place.take(tensors["response_mask"], False),
        "prompt_mask": place.take(tensors["prompt_mask"], False),
        "scores": place.take(tensors["scores"], 0.0),
        "infer_logprobs": place.take(tensors["infer_logprobs"], 0.0)[:, 1:],
    }
    out_columns = _id_columns(tensors, columns, step_level)
    if "multi_modal_inputs" in columns:  # ROLL's VL env manager's column, the same dicts
        out_columns["multi_modal_inputs"] = object_array(
            dict(m or {}) for m in columns["multi_modal_inputs"]
        )
    if extras:
        for key, value in tensors.items():
            if key not in _CONSUMED:
                fill = _PER_TOKEN_FILL.get(key, 0)
                out[key] = (
                    place.take(value, fill) if per_token(value, rows, native_width) else value
                )
        for key, col in columns.items():
            if key not in _CONSUMED or key == "observations":
                out_columns[key] = col
    return out, out_columns, dict(batch.meta_info)


def _position_ids(mask: Tensor, mrope: Tensor | None, place: Place) -> Tensor:
    """ROLL's ``position_ids``, 0 on padding: ``[B, L]`` text positions; with the native
    3-D rope positions, ``[B, 4, L]`` as its Qwen-VL ``extra_data_provider`` gives them
    (``get_rope_index``'s three axes after the text positions), cut and padded as
    ``VLTrajEnvManager.formulate_rollouts`` does."""
    text = (mask.cumsum(1) - 1) * mask
    if mrope is None:
        return text
    rope = place.take(mrope, 0).transpose(1, 2).to(torch.int64)
    return torch.cat([text[:, None], rope], dim=1)


def _id_columns(
    tensors: dict[str, Tensor], columns: dict[str, np.ndarray], step_level: bool
) -> dict[str, np.ndarray]:
    """ROLL's object columns: ids as Python values, the readable ids as strings."""
    tags = [str(t) for t in columns["tags"]]
    groups = tensors["traj_group_id"].tolist()
    episodes = tensors["traj_id"].tolist()
    group_keys = [f"{tag}_{g}" for tag, g in zip(tags, groups, strict=True)]
    if step_level:
        step_scores = object_array(float(s) for s in columns["step_scores"])
        episode_scores = object_array(tensors["episode_scores"].tolist())
    else:
        turn_rewards = [[float(r) for r in s] for s in columns["step_scores"]]
        step_scores = object_array(object_array(r) for r in turn_rewards)
        episode_scores = object_array(sum(r) for r in turn_rewards)
    out = {
        "env_ids": object_array(tensors["env_ids"].tolist()),
        "group_ids": object_array(groups),
        "tags": object_array(tags),
        "step_scores": step_scores,
        "episode_scores": episode_scores,
        "traj_group_id": object_array(group_keys),
        "traj_id": object_array(f"{k}_{e}" for k, e in zip(group_keys, episodes, strict=True)),
    }
    if step_level:
        out["state_hash"] = object_array(roll_state_hash(str(o)) for o in columns["observations"])
        out["step"] = object_array(tensors["step"].tolist())
    return out


def native_infer_logprobs(roll_infer_logprobs: Tensor) -> Tensor:
    """Un-shift ROLL's ``infer_logprobs`` (``[B, L - 1]``) back to per-token ``[B, L]``.

    The first token of a row is always a prompt token, whose logprob is 0 natively, so
    the shift loses nothing.
    """
    return torch.nn.functional.pad(roll_infer_logprobs, (1, 0))
