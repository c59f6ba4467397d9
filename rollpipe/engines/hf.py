"""HFEngine: the generation protocol on plain transformers, for users without vLLM.

Requests arriving within ``batch_window_s`` of each other are micro-batched and decoded
together, one forward step at a time on a worker thread (``hf_backend.py``). Each row
keeps its own sampling parameters and seeded generator and stops at its own
max_tokens / stop tokens / EOS (``hf_batch.py``). Pauses, weight updates and close are
handled between two steps, so each waits for at most the step in flight.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rollpipe._utils.checks import check_int
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.hf_backend import HFBackend
from rollpipe.engines.hf_images import VisionModel, load_vision_model
from rollpipe.engines.images import vision_tokens_of
from rollpipe.engines.threads import resolve_cpu_threads

__all__ = ["HFEngine"]


class HFEngine(BaseEngine):
    """A transformers causal LM behind the rollpipe ``Engine`` protocol.

    On CPU the decode thread uses ``cpu_threads`` torch threads (default 1 unless
    ``OMP_NUM_THREADS`` is set); other threads of the process keep their setting.

    A Qwen2-VL-style vision-language model (``AutoModelForImageTextToText``, with its
    processor) takes images (``generate(..., images=...)``; ``hf_images.py``).

    Examples:
        >>> from rollpipe.engines.records import SamplingParams
        >>> params = SamplingParams(max_tokens=4, ignore_eos=True)
        >>> with HFEngine(model_path) as hf:
        ...     gens = hf.generate_batch([tokenizer.encode("Hi"), [5, 6, 7]], params)
        >>> [g.num_tokens for g in gens], gens[0].finish_reason
        ([4, 4], 'length')
    """

    _backend: HFBackend

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_window_s: float = 0.005,
        max_batch_size: int = 64,
        cpu_threads: int | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        if not (Path(model_path) / "config.json").is_file():
            raise ValueError(f"HFEngine: model_path {str(model_path)!r} has no config.json")
        if not (isinstance(batch_window_s, (int, float)) and 0 <= batch_window_s <= 10):
            raise ValueError(f"HFEngine: batch_window_s must be in [0, 10], got {batch_window_s!r}")
        check_int("HFEngine: max_batch_size", max_batch_size, 1)
        self.device = torch.device(device)
        threads = resolve_cpu_threads(cpu_threads) if self.device.type == "cpu" else None
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        tokens = vision_tokens_of(model_path)
        vision: VisionModel | None = None
        if tokens is not None:  # a vision-language model, with its processor
            model, vision = load_vision_model(model_path, tokens, torch_dtype, self.device)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        text = model.config.get_text_config()
        gcfg = GenerationConfig.from_pretrained(str(model_path))
        eos = gcfg.eos_token_id if gcfg.eos_token_id is not None else text.eos_token_id
        eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        pad = gcfg.pad_token_id if gcfg.pad_token_id is not None else text.pad_token_id
        self.batch_window_s = float(batch_window_s)
        self.max_batch_size = max_batch_size
        super().__init__(name="rollpipe-hf-engine")
        self._attach(
            lambda link: HFBackend.start(
                self.model,
                link,
                eos=eos_ids,
                pad=int(pad if pad is not None else min(eos_ids, default=0)),
                max_len=int(getattr(text, "max_position_embeddings", 1 << 30)),
                device=self.device,
                batch_window_s=self.batch_window_s,
                max_batch_size=max_batch_size,
                threads=threads,
                vision=vision,
            ),
            repr(str(model_path)),
        )

    @property
    def num_batches(self) -> int:
        """Micro-batches decoded so far (micro-batching statistics).

        Examples:
            >>> from rollpipe.engines.records import SamplingParams
            >>> with HFEngine(model_path, max_batch_size=2, batch_window_s=1) as hf:
            ...     _ = hf.generate_batch([[1, 2], [3], [4], [5, 6]], SamplingParams(max_tokens=2))
            ...     hf.num_batches  # 4 requests, at most 2 a batch
            2
        """
        return self._backend.num_batches
