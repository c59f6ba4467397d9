"""Readable views of collated rows: which spans the engine generated, decoded.

:func:`show_row` is the Python twin of ``rollpipe inspect``:
one row as text, the generated spans marked. ``rollpipe run --out`` writes
:func:`decode_row` records (a JSONL of trajectories to read). Works on any ``DataProto``
with ``input_ids``, ``attention_mask`` and ``response_mask``.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from rollpipe.data.proto import DataProto


def spans(
    input_ids: torch.Tensor, attention: torch.Tensor, response: torch.Tensor
) -> list[tuple[bool, list[int]]]:
    """Split one row's real tokens into runs of (is_response, ids)."""
    ids = input_ids[attention.bool()].tolist()
    is_resp = response[attention.bool()].bool().tolist()
    out: list[tuple[bool, list[int]]] = []
    for token, resp in zip(ids, is_resp, strict=True):
        if out and out[-1][0] == resp:
            out[-1][1].append(token)
        else:
            out.append((resp, [token]))
    return out


def show_row(
    batch: DataProto, index: int, tokenizer: Any, open_mark: str = "[[", close_mark: str = "]]"
) -> str:
    """Row ``index`` of ``batch`` as text: a header line (ids, scores, end reason), then
    the row's tokens decoded, each span the engine generated (``response_mask`` 1)
    wrapped in ``open_mark ... close_mark``; the rest (prompts, tool results, chat
    scaffolding) is context. What ``rollpipe inspect FILE --row i`` prints.

    Examples:
        >>> import torch
        >>> from transformers import AutoTokenizer
        >>> from rollpipe import DataProto
        >>> from rollpipe.training.tiny_model import default_model_path
        >>> tok = AutoTokenizer.from_pretrained(str(default_model_path()))
        >>> prompt, answer = tok.encode("Hi, "), tok.encode("there")
        >>> ids = torch.tensor([prompt + answer])
        >>> generated = torch.tensor([[False] * len(prompt) + [True] * len(answer)])
        >>> row = DataProto.from_dict(
        ...     {"input_ids": ids, "attention_mask": ids > -1, "response_mask": generated}
        ... )
        >>> print(show_row(row, 0, tok))
        row 0: {}
        Hi, [[there]]
    """
    record = decode_row(batch, index, tokenizer)
    header = {k: v for k, v in record.items() if k != "spans"}
    return f"row {index}: {json.dumps(header)}\n{marked_text(record, open_mark, close_mark)}"


def decode_row(batch: DataProto, index: int, tokenizer: Any) -> dict[str, Any]:
    """One row as plain data: ids, score, end reason and the decoded prompt/response spans."""
    td = batch.batch
    if td is None or not all(k in td for k in ("input_ids", "attention_mask", "response_mask")):
        raise ValueError(
            "decode_row needs a DataProto with tensors input_ids, attention_mask and "
            f"response_mask; its columns are {batch.keys()}"
        )
    if not -len(batch) <= index < len(batch):
        raise IndexError(f"row {index} is out of range for a batch of {len(batch)} rows")
    row_spans = spans(
        td["input_ids"][index], td["attention_mask"][index], td["response_mask"][index]
    )
    nt = batch.non_tensor_batch
    record: dict[str, Any] = {
        key: _plain(nt[key][index])
        for key in ("traj_uid", "uid", "tags", "end_reasons", "step_scores")
        if key in nt
    }
    for key in ("traj_id", "traj_group_id", "env_ids", "episode_scores", "step"):
        if key in td:
            record[key] = td[key][index].item()
    record["spans"] = [
        {"role": "response" if resp else "prompt", "text": tokenizer.decode(ids)}
        for resp, ids in row_spans
    ]
    return record


def marked_text(record: dict[str, Any], open_mark: str = "[[", close_mark: str = "]]") -> str:
    """The row's text with response spans wrapped in ``open_mark ... close_mark``."""
    return "".join(
        f"{open_mark}{s['text']}{close_mark}" if s["role"] == "response" else s["text"]
        for s in record["spans"]
    )


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value
