"""What a trainer needs from image rows beyond the ids: Qwen-VL's 3-D rope positions.

Rows of image conversations (``rollpipe.data.rows.trajectory_rows``) hold the expanded
ids the model saw and, per row, ``multi_modal_inputs`` (``pixel_values``,
``image_grid_thw``) in the non-tensor columns, as verl reads them. Their
``position_ids`` column stays the 1-D text one; a Qwen2-VL / Qwen2.5-VL trainer computes
the 3-D (temporal, height, width) positions from ``input_ids``, ``attention_mask`` and
the grids, which :func:`mrope_position_ids` does with the model's own
``get_rope_index`` (transformers 5: it needs the token types, image pads = 1).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["mm_token_type_ids", "mrope_position_ids"]


def mm_token_type_ids(input_ids: torch.Tensor, image_pad_id: int) -> torch.Tensor:
    """transformers 5's token types: 1 on image pads, 0 elsewhere (int32, ``input_ids``'
    shape)."""
    return (input_ids == image_pad_id).to(torch.int32)


def mrope_position_ids(rows: Any, model: Any, image_pad_id: int) -> torch.Tensor:
    """``[B, 3, L]`` int64: each row's 3-D rope positions (the model's ``get_rope_index``
    on the row's ids, attention mask and ``multi_modal_inputs["image_grid_thw"]``); a row
    without images gets its text positions on all three axes. Padding positions are 1, as
    transformers leaves them.

    ``rows``: a ``DataProto`` of trajectory rows with ``input_ids``, ``attention_mask``
    and ``multi_modal_inputs``; ``model``: a transformers Qwen2-VL-style model (its
    ``model.get_rope_index`` or its own).
    """
    ids, mask = rows.batch["input_ids"], rows.batch["attention_mask"]
    inputs = rows.non_tensor_batch["multi_modal_inputs"]
    rope = getattr(getattr(model, "model", model), "get_rope_index", None)
    if rope is None:
        raise TypeError(
            f"mrope_position_ids: {type(model).__name__} has no get_rope_index; pass a "
            "Qwen2-VL-style transformers model"
        )
    out = torch.ones((ids.shape[0], 3, ids.shape[1]), dtype=torch.int64)
    for i in range(ids.shape[0]):
        row, row_mask = ids[i : i + 1], mask[i : i + 1]
        grid = inputs[i].get("image_grid_thw") if inputs[i] else None
        if grid is None:
            text = (row_mask.cumsum(-1) - 1).clamp(min=0)
            out[i] = torch.where(row_mask.bool(), text, torch.ones_like(text)).expand(3, -1)
            continue
        positions, _ = rope(
            input_ids=row,
            mm_token_type_ids=mm_token_type_ids(row, image_pad_id),
            image_grid_thw=grid,
            attention_mask=row_mask,
        )
        out[i] = positions[:, 0]
    return out
