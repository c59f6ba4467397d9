"""Token-exact rows: trajectories -> a padded ``DataProto`` with ROLL's field names.

A row's ``input_ids`` is exactly the concatenation of the ids the engine received and
produced (never re-tokenized text). Rows are built for the whole batch at once: the
turns' ids, logprobs and versions are converted once into flat tensors (the only
per-token Python work), rows are slices of them, and every field is padded by one
shared ``rollpipe.data.padding.FlatLayout`` to the batch's own longest row, so thousands of
trajectories cost a few tensor ops per field.

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
constrained_mask   bool     1 on generated tokens sampled under a grammar (a forced
                            tool call: ``Turn.constrained``), 0 elsewhere; inside
                            ``response_mask``
traj_group_id      int64    ``[B]`` group id
traj_id            int64    ``[B]`` episode id (unique per trajectory)
env_ids            int64    ``[B]`` env id (the env slot that ran the episode)
episode_scores     float32  ``[B]`` episode score (sum of turn rewards)
step               int64    ``[B]`` step rows only: the turn index
state_hash         int64    ``[B]`` step rows only: hash of (group id, observation)
=================  =======  ==========================================================

Non-tensor fields (1-D object arrays): ``step_scores`` (trajectory rows: the list of
turn rewards; step rows: the turn's reward), ``tags``, ``end_reasons``, ``uid`` (the
readable group id, verl's GRPO grouping key) and ``traj_uid`` (readable trajectory id);
step rows also carry ``observations`` (the text each turn answered; ROLL's ``state_hash``
is a sha256 of it, see ``rollpipe.data.roll_layout``).

Image rows (trajectories of an image conversation, ``rollpipe.vision.conversation``):
``input_ids`` hold the image pads expanded, as the model saw them, and every row carries
``multi_modal_inputs``, verl's ``non_tensor_batch["multi_modal_inputs"]``: a dict with
``pixel_values`` (the row's images' patches, concatenated in order; a step row's: its row
up to its turn) and ``image_grid_thw`` (one ``[t, h, w]`` per image); ``{}`` for a row
without images. Qwen-VL's 3-D positions come from them with ``input_ids`` and
``attention_mask`` (``rollpipe.vision.rows.mrope_position_ids``); ``position_ids`` stays
the 1-D one. Text batches get no such column.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate, chain
from typing import Any, Literal

import numpy as np
import torch

from rollpipe.agent.records import Trajectory, Turn
from rollpipe.data.padding import FlatLayout, flat_layout, padded_tokens
from rollpipe.data.proto import DataProto
from rollpipe.data.proto.columns import object_array


def state_hash(group_id: int, observation: str) -> int:
    """Stable signed int64 hash of ``(group_id, observation)`` (blake2b, any process)."""
    digest = hashlib.blake2b(
        f"{group_id}\x00{observation}".encode(), digest_size=8, person=b"rollpipe"
    ).digest()
    return int.from_bytes(digest, "little", signed=True)


class _Stream:
    """Every turn's prompt and response ids of a batch, converted to tensors once.

    ``ids`` holds each trajectory's segments (prompt 0, response 0, prompt 1, ...) one
    trajectory after another; ``logprobs``, ``versions`` and ``constrained`` hold only the
    response tokens, in the same order. ``starts[k]`` is where trajectory ``k`` begins in
    ``ids``. Each ``Turn`` carries its ids and logprobs packed as arrays (made when the
    turn was recorded), so this is one concatenation per field, at memory-copy speed.
    """

    def __init__(self, trajectories: Sequence[Trajectory]) -> None:
        turns = [u for t in trajectories for u in t.turns]
        n_resp = sum(len(u.response_ids) for u in turns)
        pieces = [a for u in turns for a in (u.prompt_array, u.response_array)]
        self.ids = torch.from_numpy(np.concatenate(pieces))
        self.logprobs = torch.from_numpy(np.concatenate([u.logprob_array for u in turns]))
        self.versions = _versions([u.versions for u in turns], n_resp)
        flags = np.array([u.constrained for u in turns], dtype=np.bool_)
        lengths = [len(u.response_ids) for u in turns]
        self.constrained = torch.from_numpy(np.repeat(flags, lengths))
        sizes = [
            sum(len(u.prompt_ids) + len(u.response_ids) for u in t.turns) for t in trajectories
        ]
        self.starts = list(accumulate(sizes, initial=0))[:-1]


def _flat(parts: Sequence[Sequence[int | float]], dtype: type, count: int) -> torch.Tensor:
    """``parts`` concatenated into one 1-D tensor of ``dtype``."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(parts), dtype=dtype, count=count))


def _versions(parts: Sequence[tuple[int, ...]], count: int) -> torch.Tensor:
    """``parts`` (each turn's versions) concatenated into one int64 tensor.

    A turn is usually generated by one policy version, so when every turn's versions are
    all equal (``tuple.count`` checks that at C speed) each turn is one repeated value and
    the per-token conversion is skipped.
    """
    firsts = [p[0] if p else 0 for p in parts]
    if all(p.count(v) == len(p) for p, v in zip(parts, firsts, strict=True)):
        lengths = [len(p) for p in parts]
        return torch.from_numpy(np.repeat(np.array(firsts, dtype=np.int64), lengths))
    return _flat(parts, np.int64, count)


class _Rows:
    """Rows as slices of a ``_Stream`` and runs of response / non-response tokens."""

    def __init__(self) -> None:
        self.slices: list[tuple[int, int]] = []  # (start in stream.ids, length)
        self.run_lengths: list[int] = []  # runs covering each row in order
        self.run_is_response: list[bool] = []
        self.prompt_lengths: list[int] = []  # tokens before the first response token
        self.scores: list[float] = []

    def add_row(self, start: int, runs: Iterable[tuple[int, bool]], score: float) -> int:
        """Add the row of ``runs`` (length, is response) starting at ``start`` in the
        stream; returns its length."""
        length, prompt = 0, None
        for n, is_resp in runs:
            if is_resp and n > 0 and prompt is None:
                prompt = length
            self.run_lengths.append(n)
            self.run_is_response.append(is_resp)
            length += n
        self.slices.append((start, length))
        self.prompt_lengths.append(length if prompt is None else prompt)
        self.scores.append(score)
        return length

    def tensors(
        self,
        stream: _Stream,
        pad_token_id: int,
        side: Literal["right", "left"],
        multiple_of: int | None,
    ) -> dict[str, torch.Tensor]:
        """All per-token fields, padded by one shared layout."""
        layout = flat_layout([n for _, n in self.slices], side=side, multiple_of=multiple_of)
        tokens = padded_tokens(layout, self._ids(stream), pad_token_id)
        is_resp = np.repeat(np.array(self.run_is_response, dtype=np.bool_), self.run_lengths)
        response_mask = layout.pad(torch.from_numpy(is_resp), False)
        # response tokens in row-major order are the stream's response tokens, in order
        infer_logprobs = layout.pad(stream.logprobs, 0.0, where=response_mask)
        policy_versions = layout.pad(stream.versions, -1, where=response_mask)
        constrained_mask = layout.pad(stream.constrained, False, where=response_mask)
        return {
            "input_ids": tokens.input_ids,
            "attention_mask": tokens.attention_mask,
            "position_ids": tokens.position_ids,
            "response_mask": response_mask,
            "prompt_mask": layout.prefix_mask(torch.tensor(self.prompt_lengths)),
            "scores": self._scores(layout),
            "infer_logprobs": infer_logprobs,
            "policy_versions": policy_versions,
            "constrained_mask": constrained_mask,
        }

    def _ids(self, stream: _Stream) -> torch.Tensor:
        """The rows' ids, row after row (the stream itself when rows tile it)."""
        position = 0
        for start, n in self.slices:
            if start != position:
                return torch.cat([stream.ids[a : a + n] for a, n in self.slices])
            position += n
        return stream.ids if position == stream.ids.numel() else stream.ids[:position]

    def _scores(self, layout: FlatLayout) -> torch.Tensor:
        """Each row's score on its last token (the last flat element before its end)."""
        out = torch.zeros((len(self.scores), layout.width), dtype=torch.float32)
        ends = torch.cumsum(layout.lengths, 0) - 1
        out[layout.locate(ends)] = torch.tensor(self.scores, dtype=torch.float32)
        return out


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


def _segments(turns: Sequence[Turn]) -> list[list[Turn]]:
    """``turns`` cut before each ``new_row`` turn (one segment for most trajectories)."""
    segments: list[list[Turn]] = []
    for u in turns:
        if u.new_row or not segments:
            segments.append([])
        segments[-1].append(u)
    return segments


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


def _label_columns(
    trajectories: Sequence[Trajectory], repeats: Sequence[int], step_scores: list[Any]
) -> dict[str, np.ndarray]:
    """The object columns: each trajectory's labels, repeated once per row it gave."""

    def col(values: list[Any]) -> np.ndarray:
        return object_array(_repeat(values, repeats))

    columns = {
        "step_scores": object_array(step_scores),
        "tags": col([t.tag for t in trajectories]),
        "end_reasons": col([t.end_reason for t in trajectories]),
        "uid": col([t.group_uid for t in trajectories]),
        "traj_uid": col([t.traj_id for t in trajectories]),
    }
    row_index = [t.spec.row_index for t in trajectories]
    if row_index and all(i is not None for i in row_index):  # drawn from a dataset
        columns["row_index"] = col(row_index)
    return columns


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
    A trajectory whose turns start new rows (``Turn.new_row``: an agent that rewrote
    its history) gives one row per such segment, each with the episode's labels and
    score: the engine never saw the segments as one sequence.

    Examples:
        >>> from rollpipe.agent.records import EpisodeSpec
        >>> done = dict(finish_reason="stop", action_valid=True, action_text="", observation="o")
        >>> turns = [Turn([1, 2], [3, 4], [-0.5, -0.5], [0, 0], 0.0, **done),
        ...          Turn([5], [6], [-0.1], [0], 1.0, **done)]
        >>> traj = Trajectory(EpisodeSpec(group_id=0, episode_id=0, seed=0), env_id=0,
        ...                   turns=turns, score=1.0, success=True, end_reason="terminated")
        >>> rows = trajectory_rows([traj], pad_token_id=0)
        >>> rows["input_ids"], rows["response_mask"].int(), rows["scores"]
        (tensor([[1, 2, 3, 4, 5, 6]]), tensor([[0, 0, 1, 1, 0, 1]], dtype=torch.int32),
         tensor([[0., 0., 0., 0., 0., 1.]]))
        >>> rows["uid"], rows["step_scores"]
        (array(['frozenlake/g0'], dtype=object), array([list([0.0, 1.0])], dtype=object))
    """
    trajs = list(trajectories)
    _check(trajs, need_conversation=True)
    stream = _Stream(trajs)
    rows = _Rows()
    counts: list[int] = []
    for t, start in zip(trajs, stream.starts, strict=True):
        offset = 0
        segments = _segments(t.turns)
        for segment in segments:
            runs = [
                run
                for u in segment
                for run in ((len(u.prompt_ids), False), (len(u.response_ids), True))
            ]
            offset += rows.add_row(start + offset, runs, t.score)
        counts.append(len(segments))
    tensors = rows.tensors(stream, pad_token_id, padding_side, pad_to_multiple_of)
    tensors.update(_ids_fields(trajs, counts))
    step_scores = _repeat([t.step_scores for t in trajs], counts)
    non_tensors = _label_columns(trajs, counts, step_scores)
    if any(getattr(u, "image_grid_thw", None) is not None for t in trajs for u in t.turns):
        non_tensors["multi_modal_inputs"] = object_array(
            _image_inputs(segment) for t in trajs for segment in _segments(t.turns)
        )
    return DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info=dict(meta_info or {})
    )


def _image_inputs(turns: Sequence[Turn]) -> dict[str, torch.Tensor]:
    """A row's ``multi_modal_inputs``: its turns' image features, concatenated."""
    images: list[Any] = [u for u in turns if getattr(u, "image_grid_thw", None) is not None]
    if not images:
        return {}
    return {
        "pixel_values": torch.cat([u.pixel_values for u in images]),
        "image_grid_thw": torch.cat([u.image_grid_thw for u in images]),
    }


def _step_image_inputs(trajectories: Sequence[Trajectory]) -> Iterable[dict[str, Any]]:
    """Each step row's ``multi_modal_inputs``: the images of its row so far (its
    segment's turns up to this one; its own turn's alone in window mode)."""
    for t in trajectories:
        first = 0
        for i, u in enumerate(t.turns):
            first = i if u.new_row or t.history_window is not None else first
            yield _image_inputs(t.turns[first : i + 1])


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

    Examples:
        >>> from rollpipe.agent.records import EpisodeSpec
        >>> done = dict(finish_reason="stop", action_valid=True, action_text="", observation="o")
        >>> turns = [Turn([1, 2], [3, 4], [-0.5, -0.5], [0, 0], 0.0, **done),
        ...          Turn([5], [6], [-0.1], [0], 1.0, **done)]
        >>> traj = Trajectory(EpisodeSpec(group_id=0, episode_id=0, seed=0), env_id=0,
        ...                   turns=turns, score=1.0, success=True, end_reason="terminated")
        >>> rows = step_rows([traj], pad_token_id=0)  # one row per turn, padded on the right
        >>> rows["input_ids"], rows["response_mask"].int()
        (tensor([[1, 2, 3, 4, 0, 0], [1, 2, 3, 4, 5, 6]]),
         tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.int32))
        >>> rows["step"], rows["step_scores"], rows["episode_scores"]
        (tensor([0, 1]), array([0.0, 1.0], dtype=object), tensor([1., 1.]))
    """
    trajs = list(trajectories)
    _check(trajs, need_conversation=False)
    stream = _Stream(trajs)
    rows = _Rows()
    steps: list[int] = []
    hashes: list[int] = []
    observations: list[str] = []
    rewards: list[float] = []
    for t, start in zip(trajs, stream.starts, strict=True):
        offset = 0  # where this turn's prompt starts, from the trajectory's start
        row = 0  # where the turn's row (segment) starts: a new_row turn starts one
        for i, u in enumerate(t.turns):
            prompt, response = len(u.prompt_ids), len(u.response_ids)
            row = offset if u.new_row else row
            # conversation mode: the row's earlier turns, then this turn's prompt (one slice)
            context = offset - row + prompt if t.history_window is None else prompt
            row_start = start + row if t.history_window is None else start + offset
            rows.add_row(row_start, [(context, False), (response, True)], u.reward)
            offset += prompt + response
            steps.append(i)
            hashes.append(state_hash(t.group_id, u.observation))
            observations.append(u.observation)
            rewards.append(u.reward)
    counts = [len(t.turns) for t in trajs]
    tensors = rows.tensors(stream, pad_token_id, padding_side, pad_to_multiple_of)
    tensors.update(_ids_fields(trajs, counts))
    tensors["step"] = torch.tensor(steps, dtype=torch.int64)
    tensors["state_hash"] = torch.tensor(hashes, dtype=torch.int64)
    non_tensors = _label_columns(trajs, counts, rewards)
    non_tensors["observations"] = object_array(observations)
    if any(getattr(u, "image_grid_thw", None) is not None for t in trajs for u in t.turns):
        non_tensors["multi_modal_inputs"] = object_array(_step_image_inputs(trajs))
    return DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info=dict(meta_info or {})
    )
