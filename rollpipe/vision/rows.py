"""What a trainer needs from image rows beyond the ids: Qwen-VL's 3-D rope positions.

Rows of image conversations (``rollpipe.data.rows.trajectory_rows``) hold the expanded
ids the model saw and, per row, ``multi_modal_inputs`` (``pixel_values``,
``image_grid_thw``) in the non-tensor columns, as verl reads them. Their
``position_ids`` column stays the 1-D text one; a Qwen2-VL / Qwen2.5-VL trainer computes
the 3-D (temporal, height, width) positions from ``input_ids``, ``attention_mask`` and
the grids, which :func:`mrope_position_ids` does with the model's own
``get_rope_index`` (transformers 5: it needs the token types, image pads = 1).

:func:`with_mrope_positions` stores them in the batch as the per-token tensor
``mrope_position_ids`` (int64 ``[B, L, 3]``, channel last so that it is padded, cut and
re-aligned like every per-token field); ``to_verl()`` / ``to_roll()`` then give
``position_ids`` as verl's agent loop and ROLL's VL env manager lay them out for
Qwen-VL: ``[B, 4, L]``, the text positions first, then the three rope axes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MROPE_KEY", "mm_token_type_ids", "mrope_position_ids", "with_mrope_positions"]

MROPE_KEY = "mrope_position_ids"
"""The native per-token tensor :func:`with_mrope_positions` adds (``[B, L, 3]``)."""


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
    inputs = rows.non_tensor_batch.get("multi_modal_inputs", [None] * ids.shape[0])
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


def with_mrope_positions(rows: Any, model: Any, image_pad_id: int | None = None) -> Any:
    """``rows`` (native trajectory or step rows) with ``mrope_position_ids``: int64
    ``[B, L, 3]``, each token's (temporal, height, width) rope position from the model's
    own ``get_rope_index`` (:func:`mrope_position_ids`, moved channel last); 1 on padding.

    ``image_pad_id``: the image pad token (default: the model config's
    ``image_token_id``). The layouts read the column: ``rows.to_verl()`` gives
    ``position_ids`` ``[B, 4, prompt + response]`` as verl's agent loop computes them for
    a processor with ``get_rope_index``, ``rows.to_roll()`` ``[B, 4, L]`` as ROLL's
    Qwen-VL collator does.

    Examples:
        >>> rows = with_mrope_positions(rows, hf_vlm)  # doctest: +SKIP
        >>> rows.to_verl().batch["position_ids"].shape  # doctest: +SKIP
        torch.Size([4, 4, 203])
    """
    if image_pad_id is None:
        config = getattr(model, "config", None)
        image_pad_id = getattr(config, "image_token_id", None)
        if image_pad_id is None:
            raise ValueError(
                f"with_mrope_positions: {type(model).__name__} has no config.image_token_id; "
                "pass image_pad_id (the <|image_pad|> token id)"
            )
    positions = mrope_position_ids(rows, model, int(image_pad_id))
    tensors = {k: rows.batch.get(k) for k in rows.batch.keys()}  # noqa: SIM118
    tensors[MROPE_KEY] = positions.transpose(1, 2).contiguous()
    return type(rows).from_dict(
        tensors=tensors, non_tensors=dict(rows.non_tensor_batch), meta_info=dict(rows.meta_info)
    )
