"""HFEngine's image requests: a Qwen2-VL-style model's processor, expansion and positions.

An image request decodes alone (a micro-batch of one ``ImageRow``): its prefill runs the
model's image processor on all of the request's images (``pixel_values``,
``image_grid_thw``), expands each image pad into the image's tokens
(``expand_image_pads``), computes the 3-D rotary positions with the model's
``get_rope_index`` (which needs ``mm_token_type_ids``: 1 on image tokens) and feeds it
all at once; decoding then goes on as for text, one token a step, each new position one
past the last. Text requests to the same model keep their micro-batches
(``hf_batch.DecodeBatch``); neither ever samples a vision token.

Models whose image processor returns no ``image_grid_thw`` (LLaVA-style) are refused:
use a VLLMEngine for those.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rollpipe.engines.hf_batch import DecodeBatch, Row, _new_cache
from rollpipe.engines.images import VisionTokens, expand_image_pads
from rollpipe.engines.records import EngineError, Generation, SamplingParams

__all__ = ["ImageDecode", "ImageRow", "VisionModel", "load_vision_model"]


class VisionModel:
    """What an image request needs of the model: its vision tokens, its image processor
    (with the merge size) and the position function, and its context length."""

    def __init__(self, model: Any, processor: Any, tokens: VisionTokens, max_len: int) -> None:
        self.model = model
        self.image_processor = processor.image_processor
        self.merge_size = int(getattr(self.image_processor, "merge_size", 1))
        self.tokens = tokens
        self.max_len = max_len
        self.rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)

    def inputs(self, row: ImageRow, device: torch.device) -> dict[str, torch.Tensor]:
        """The prefill inputs of ``row``; sets ``row.expanded``."""
        out = self.image_processor(images=list(row.images), return_tensors="pt")
        grid = out.get("image_grid_thw")
        if grid is None:
            raise EngineError(
                f"HFEngine takes images for Qwen2-VL-style models only (its image processor "
                f"{type(self.image_processor).__name__} gives no image_grid_thw); use a VLLMEngine"
            )
        pad = self.tokens.image_pad
        row.expanded = expand_image_pads(row.prompt, grid, self.merge_size, pad)
        if len(row.expanded) + row.params.max_tokens > self.max_len:
            raise EngineError(
                f"the expanded prompt ({len(row.expanded)} tokens with its images) + "
                f"max_tokens ({row.params.max_tokens}) exceeds the model's {self.max_len} "
                "positions; shorten the conversation or lower max_tokens"
            )
        ids = torch.tensor([row.expanded], dtype=torch.long, device=device)
        types = (ids == pad).to(torch.int)  # mm_token_type_ids: 1 on image tokens
        if self.rope_index is not None:
            positions, _ = self.rope_index(
                ids, mm_token_type_ids=types, image_grid_thw=grid.to(device)
            )
        else:
            positions = torch.arange(ids.shape[1], device=device)[None]
        return {
            "input_ids": ids,
            "position_ids": positions,
            "pixel_values": out["pixel_values"].to(device),
            "image_grid_thw": grid.to(device),
            "mm_token_type_ids": types,
        }


def load_vision_model(
    model_path: str | os.PathLike[str], tokens: VisionTokens, dtype: Any, device: torch.device
) -> tuple[Any, VisionModel]:
    """The transformers model (``AutoModelForImageTextToText``) and its ``VisionModel``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(model_path), dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]
    processor = AutoProcessor.from_pretrained(str(model_path))
    text = model.config.get_text_config()
    max_len = int(getattr(text, "max_position_embeddings", 1 << 30))
    return model, VisionModel(model, processor, tokens, max_len)


class ImageRow(Row):
    """A request with images; ``expanded`` is its prompt with each pad expanded (set at
    prefill) and comes back as the generation's ``prompt_token_ids``."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        eos: frozenset[int],
        arrived: float,
        images: tuple[Any, ...],
    ) -> None:
        super().__init__(prompt, params, eos, arrived)
        self.images = images
        self.expanded: list[int] | None = None

    def finish(self, reason: str) -> None:
        if not self.fut.done():
            gen = Generation(
                self.tokens,
                self.logprobs,
                reason,
                self.versions,
                top_logprobs=self.top,
                prompt_token_ids=self.expanded,
            )
            self.fut.set_result(gen)


class ImageDecode(DecodeBatch):
    """One ``ImageRow`` decoded alone: its prefill is ``VisionModel.inputs``."""

    def __init__(
        self,
        model: Any,
        rows: list[Row],
        pad: int,
        device: torch.device,
        extra: dict[str, int],
        vision: VisionModel,
    ) -> None:
        if len(rows) != 1 or not isinstance(rows[0], ImageRow):
            raise ValueError("ImageDecode decodes exactly one ImageRow")
        banned = torch.tensor(vision.tokens.banned, dtype=torch.long, device=device)
        super().__init__(model, rows, pad, device, extra, banned=banned)
        self.vision = vision

    def _prefill(self) -> dict[str, torch.Tensor]:
        row = self.rows[0]
        assert isinstance(row, ImageRow)
        inputs = self.vision.inputs(row, self.device)
        self.mask = torch.ones_like(inputs["input_ids"])
        self.position = inputs["position_ids"][..., -1:]  # [3, 1, 1] with 3-D positions
        self.cache = _new_cache(self.model)
        return inputs
