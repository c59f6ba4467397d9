"""rollpipe trajectory rows as what TRL's ``rollout_func`` returns.

TRL's ``GRPOTrainer`` wants, per completion, ``prompt_ids`` (the tokens before the first
generated one), ``completion_ids`` (everything after: the model's turns *and* the env's
observations between them), ``logprobs`` over ``completion_ids`` and an ``env_mask``
over ``completion_ids`` (1 on tokens the model generated, 0 on env / tool tokens, which
TRL leaves out of the loss). A rollpipe trajectory row holds exactly that:
``prompt_mask`` splits it, ``response_mask`` is the env mask, ``infer_logprobs`` the
engine's log-probabilities (0 on env tokens). Nothing is re-tokenized.

Rows must be ``level="trajectory"`` rows in rollpipe's native layout (the default).
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase

from rollpipe.data.proto import DataProto

__all__ = ["NEEDED_FIELDS", "trl_fields"]

NEEDED_FIELDS = (
    "input_ids",
    "attention_mask",
    "prompt_mask",
    "response_mask",
    "infer_logprobs",
    "episode_scores",
)


def _tensors(batch: DataProto) -> TensorDictBase:
    """The batch's tensors, checked to hold ``NEEDED_FIELDS``."""
    tensors = batch.batch
    keys = set() if tensors is None else set(tensors.keys())
    missing = [k for k in NEEDED_FIELDS if k not in keys]
    if missing or tensors is None or "step" in keys:  # step rows carry a ``step`` field
        raise ValueError(
            f"trl_fields: the batch lacks {missing} or holds step rows; build the pipeline with "
            "collate level='trajectory' and layout='native' (the defaults)"
        )
    return tensors


def trl_fields(batch: DataProto) -> dict[str, list[Any]]:
    """One list entry per row: ``prompt_ids``, ``completion_ids``, ``logprobs``,
    ``env_mask`` (TRL's names) and ``episode_score``, ``end_reason``, ``uid``,
    ``traj_uid`` (extra fields TRL hands to reward functions).

    A row with no generated token cannot be a TRL completion and fails, naming it.
    """
    b = _tensors(batch)
    real = b["attention_mask"].bool()
    prompt = b["prompt_mask"].bool() & real
    out: dict[str, list[Any]] = {
        "prompt_ids": [],
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
    }
    for i in range(b["input_ids"].shape[0]):
        completion = real[i] & ~prompt[i]
        if not bool(b["response_mask"][i].any()):
            raise ValueError(
                f"trl_fields: row {i} has no generated token (prompt only); TRL needs a "
                "completion per row: raise EpisodeSettings.max_length or shorten the prompt"
            )
        out["prompt_ids"].append(b["input_ids"][i][prompt[i]].tolist())
        out["completion_ids"].append(b["input_ids"][i][completion].tolist())
        out["logprobs"].append(b["infer_logprobs"][i][completion].tolist())
        out["env_mask"].append(b["response_mask"][i][completion].int().tolist())
    out["episode_score"] = b["episode_scores"].tolist()
    for name, key in (("end_reason", "end_reasons"), ("uid", "uid"), ("traj_uid", "traj_uid")):
        if key in batch.non_tensor_batch:
            out[name] = [str(v) for v in batch.non_tensor_batch[key]]
    return out
