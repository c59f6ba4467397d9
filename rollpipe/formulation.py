"""Token-exact rows: trajectories -> a padded ``DataProto`` with ROLL's field names.

A row's ``input_ids`` is exactly the concatenation of the ids the engine received and
produced (never re-tokenized text). Rows are built for the whole batch at once: every
field is one flat tensor cut by row lengths and padded once (``rollpipe.padding``), to
the batch's own longest row, so thousands of trajectories cost a few tensor ops.

Tensor fields (``[B, L]`` unless noted):

=================  =======  ==========================================================
input_ids          int64    prompt and response ids, padded with ``pad_token_id``
attention_mask     int64    1 on real tokens
position_ids       int64    ``cumsum(attention_mask) - 1``, clipped at 0
response_mask      bool     1 only on tokens the engine generated for this row
prompt_mask        bool     1 on the tokens before the row's first generated token
scores             float32  the row's score on its last token, 0 elsewhere
infer_logprobs     float32  engine logprob of each generated token, 0 elsewhere
policy_versions    int64    policy version that generated each token, -1 elsewhere
traj_group_id      int64    ``[B]`` group id
traj_id            int64    ``[B]`` episode id (unique per trajectory)
env_ids            int64    ``[B]`` env id (the env slot that ran the episode)
episode_scores     float32  ``[B]`` episode score (sum of turn rewards)
step               int64    ``[B]`` step rows only: the turn index
state_hash         int64    ``[B]`` step rows only: hash of (group id, observation)
=================  =======  ==========================================================

Non-tensor fields (1-D object arrays): ``step_scores`` (trajectory rows: the list of
turn rewards; step rows: the turn's reward), ``tags``, ``end_reasons``, ``uid`` (the
readable group id, verl's GRPO grouping key) and ``traj_uid`` (readable trajectory id).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, Literal

import numpy as np
import torch

from rollpipe.padding import pad_1d, pad_tokens
from rollpipe.proto import DataProto
from rollpipe.trajectory import Trajectory


def state_hash(group_id: int, observation: str) -> int:
    """Stable signed int64 hash of ``(group_id, observation)`` (blake2b, any process)."""
    digest = hashlib.blake2b(
        f"{group_id}\x00{observation}".encode(), digest_size=8, person=b"rollpipe"
    ).digest()
    return int.from_bytes(digest, "little", signed=True)


def _objects(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


class _Rows:
    """Collects rows as segments (runs of ids sharing mask flags), then tensorizes."""

    def __init__(self) -> None:
        self.ids: list[tuple[int, ...]] = []
        self.resp: list[bool] = []
        self.before: list[bool] = []
        self.logprobs: list[tuple[float, ...]] = []
        self.versions: list[tuple[int, ...]] = []
        self.row_segments: list[int] = []
        self.scores: list[float] = []

    def add_row(
        self,
        segments: Iterable[tuple[tuple[int, ...], bool, tuple[float, ...], tuple[int, ...]]],
        score: float,
    ) -> None:
        seen_response = False
        n = 0
        for ids, is_resp, logprobs, versions in segments:
            seen_response = seen_response or (is_resp and len(ids) > 0)
            self.ids.append(ids)
            self.resp.append(is_resp)
            self.before.append(not seen_response)
            if is_resp:
                self.logprobs.append(logprobs)
                self.versions.append(versions)
            n += 1
        self.row_segments.append(n)
        self.scores.append(score)

    def tensors(
        self, pad_token_id: int, side: Literal["right", "left"], multiple_of: int | None
    ) -> dict[str, torch.Tensor]:
        seg_lens = torch.tensor([len(s) for s in self.ids], dtype=torch.int64)
        flat_ids = torch.tensor(list(chain.from_iterable(self.ids)), dtype=torch.int64)
        resp = torch.repeat_interleave(torch.tensor(self.resp, dtype=torch.bool), seg_lens)
        before = torch.repeat_interleave(torch.tensor(self.before, dtype=torch.bool), seg_lens)
        logprobs = torch.zeros(flat_ids.numel(), dtype=torch.float32)
        logprobs[resp] = torch.tensor(list(chain.from_iterable(self.logprobs)), dtype=torch.float32)
        versions = torch.full((flat_ids.numel(),), -1, dtype=torch.int64)
        versions[resp] = torch.tensor(list(chain.from_iterable(self.versions)), dtype=torch.int64)
        seg_row = torch.repeat_interleave(
            torch.arange(len(self.row_segments)), torch.tensor(self.row_segments)
        )
        row_lens = torch.zeros(len(self.row_segments), dtype=torch.int64)
        row_lens.index_add_(0, seg_row, seg_lens)
        scores = torch.zeros(flat_ids.numel(), dtype=torch.float32)
        scores[torch.cumsum(row_lens, 0) - 1] = torch.tensor(self.scores, dtype=torch.float32)

        sizes = row_lens.tolist()
        padded = pad_tokens(
            list(torch.split(flat_ids, sizes)), pad_token_id, side=side, multiple_of=multiple_of
        )
        length = padded.input_ids.shape[1]

        def pad(flat: torch.Tensor, value: int | float) -> torch.Tensor:
            return pad_1d(list(torch.split(flat, sizes)), value, side=side, length=length)

        return {
            "input_ids": padded.input_ids,
            "attention_mask": padded.attention_mask,
            "position_ids": padded.position_ids,
            "response_mask": pad(resp, 0),
            "prompt_mask": pad(before, 0),
            "scores": pad(scores, 0.0),
            "infer_logprobs": pad(logprobs, 0.0),
            "policy_versions": pad(versions, -1),
        }


def _check(trajectories: Sequence[Trajectory], need_conversation: bool) -> None:
    if not trajectories:
        raise ValueError("formulation needs at least one trajectory, got none")
    empty = [t.traj_id for t in trajectories if not t.turns]
    if empty:
        raise ValueError(
            f"trajectories {empty[:5]} have no turns (end_reason "
            f"{[t.end_reason for t in trajectories if not t.turns][:5]}); drop trajectories "
            "with `not traj.turns` before building rows"
        )
    if need_conversation:
        windowed = [t.traj_id for t in trajectories if t.history_window is not None]
        if windowed:
            raise ValueError(
                f"trajectories {windowed[:5]} were run with ChatFormat(history_window=...): "
                "each turn saw its own prompt, so there is no single token-exact sequence; "
                "use step_rows for them"
            )


def _ids_fields(trajectories: Sequence[Trajectory], repeats: Sequence[int]) -> dict[str, Any]:
    def col(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.repeat_interleave(torch.tensor(values, dtype=dtype), torch.tensor(repeats))

    return {
        "traj_group_id": col([t.group_id for t in trajectories], torch.int64),
        "traj_id": col([t.episode_id for t in trajectories], torch.int64),
        "env_ids": col([t.env_id for t in trajectories], torch.int64),
        "episode_scores": col([t.score for t in trajectories], torch.float32),
    }


def _repeat(values: Sequence[Any], repeats: Sequence[int]) -> list[Any]:
    return [v for v, n in zip(values, repeats, strict=True) for _ in range(n)]


def trajectory_rows(
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    *,
    pad_to_multiple_of: int | None = None,
    padding_side: Literal["right", "left"] = "right",
    meta_info: Mapping[str, Any] | None = None,
) -> DataProto:
    """One row per trajectory: all turns' prompt and response ids, in order.

    Needs conversation-mode trajectories with at least one turn. ``scores`` holds the
    episode score on the last (response) token; ``prompt_mask`` covers the first prompt.
    """
    trajs = list(trajectories)
    _check(trajs, need_conversation=True)
    rows = _Rows()
    for t in trajs:
        rows.add_row(
            chain.from_iterable(
                ((u.prompt_ids, False, (), ()), (u.response_ids, True, u.logprobs, u.versions))
                for u in t.turns
            ),
            t.score,
        )
    ones = [1] * len(trajs)
    tensors = rows.tensors(pad_token_id, padding_side, pad_to_multiple_of)
    tensors.update(_ids_fields(trajs, ones))
    non_tensors = {
        "step_scores": _objects([t.step_scores for t in trajs]),
        "tags": _objects([t.tag for t in trajs]),
        "end_reasons": _objects([t.end_reason for t in trajs]),
        "uid": _objects([t.group_uid for t in trajs]),
        "traj_uid": _objects([t.traj_id for t in trajs]),
    }
    return DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info=dict(meta_info or {})
    )


def step_rows(
    trajectories: Sequence[Trajectory],
    pad_token_id: int,
    *,
    pad_to_multiple_of: int | None = None,
    padding_side: Literal["right", "left"] = "right",
    meta_info: Mapping[str, Any] | None = None,
) -> DataProto:
    """One row per turn (GiGPO style): exactly the prompt the engine got and its response.

    Window-mode turns hold their whole prompt; for conversation-mode trajectories the
    prompt is rebuilt from all earlier turns' ids, so either way the row is the tokens
    of that engine request. ``response_mask`` marks only this turn's response;
    ``scores`` holds the turn's reward on the last token; ``episode_scores`` the episode
    score; ``state_hash`` hashes (group id, the observation the turn answered).
    """
    trajs = list(trajectories)
    _check(trajs, need_conversation=False)
    rows = _Rows()
    steps: list[int] = []
    hashes: list[int] = []
    rewards: list[float] = []
    for t in trajs:
        prefix: list[tuple[tuple[int, ...], bool, tuple[float, ...], tuple[int, ...]]] = []
        for i, u in enumerate(t.turns):
            if t.history_window is None:
                prefix.append((u.prompt_ids, False, (), ()))
                segments = [*prefix, (u.response_ids, True, u.logprobs, u.versions)]
                prefix.append((u.response_ids, False, (), ()))
            else:
                segments = [
                    (u.prompt_ids, False, (), ()),
                    (u.response_ids, True, u.logprobs, u.versions),
                ]
            rows.add_row(segments, u.reward)
            steps.append(i)
            hashes.append(state_hash(t.group_id, u.observation))
            rewards.append(u.reward)
    counts = [len(t.turns) for t in trajs]
    tensors = rows.tensors(pad_token_id, padding_side, pad_to_multiple_of)
    tensors.update(_ids_fields(trajs, counts))
    tensors["step"] = torch.tensor(steps, dtype=torch.int64)
    tensors["state_hash"] = torch.tensor(hashes, dtype=torch.int64)
    non_tensors = {
        "step_scores": _objects(rewards),
        "tags": _objects(_repeat([t.tag for t in trajs], counts)),
        "end_reasons": _objects(_repeat([t.end_reason for t in trajs], counts)),
        "uid": _objects(_repeat([t.group_uid for t in trajs], counts)),
        "traj_uid": _objects(_repeat([t.traj_id for t in trajs], counts)),
    }
    return DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info=dict(meta_info or {})
    )
