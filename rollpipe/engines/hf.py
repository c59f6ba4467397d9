"""HFEngine: the generation protocol on plain transformers, for users without vLLM.

Requests arriving within ``batch_window_s`` of each other are micro-batched into one
left-padded ``model.generate`` call, run on a worker thread. Each row keeps its own
sampling parameters: a logits processor samples every row with the row's own seeded
generator (temperature / top-k / top-p) and hands ``generate`` a one-hot choice, and a
stopping criterion ends each row at its own max_tokens / stop tokens / EOS. The same
criterion is where a running batch parks while the engine is paused ("keep") or
updating weights, and where "abort" ends it early.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import torch

from rollpipe.engines.base import (
    BaseEngine,
    EngineClosedError,
    EngineError,
    Generation,
    PauseMode,
    SamplingParams,
    resolve_cpu_threads,
    set_thread_torch_threads,
)

__all__ = ["HFEngine"]


class _Row:
    """One request inside a micro-batch."""

    def __init__(self, prompt: list[int], params: SamplingParams, eos: frozenset[int]) -> None:
        self.prompt = prompt
        self.params = params
        self.fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos)
        self.gen: torch.Generator | None = None
        self.done: tuple[int, str] | None = None  # (number of tokens, finish reason)


def _sample_row(scores: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    logits = scores.float() / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= p.top_p  # keep the first crossing
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


class HFEngine(BaseEngine):
    """transformers ``generate`` behind the rollpipe ``Engine`` protocol.

    On CPU the generate thread uses ``cpu_threads`` torch threads (default 1 unless
    ``OMP_NUM_THREADS`` is set); other threads of the process keep their setting.
    """

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
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(
                f"HFEngine: max_batch_size must be an int >= 1, got {max_batch_size!r}"
            )
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype)
        self.model = model.to(torch.device(device)).eval()  # type: ignore[arg-type]
        gcfg = GenerationConfig.from_pretrained(str(model_path))
        eos = gcfg.eos_token_id if gcfg.eos_token_id is not None else model.config.eos_token_id
        self._eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        pad = gcfg.pad_token_id if gcfg.pad_token_id is not None else model.config.pad_token_id
        self._pad = int(pad if pad is not None else min(self._eos, default=0))
        # generate() merges the model's defaults into ours; keep only what we set.
        self.model.generation_config = GenerationConfig(pad_token_id=self._pad)
        self._max_len = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.device = torch.device(device)
        self.batch_window_s = float(batch_window_s)
        self.max_batch_size = max_batch_size
        self.num_batches = 0  # generate calls so far (micro-batching statistics)
        super().__init__(name="rollpipe-hf-engine")
        threads = resolve_cpu_threads(cpu_threads) if self.device.type == "cpu" else None
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, "rollpipe-hf-generate", initializer=set_thread_torch_threads, initargs=(threads,)
        )
        self._mode: str | None = None
        self._gate = threading.Event()  # open = generate may take its next step
        self._gate.set()
        self._parked = threading.Event()  # the running generate waits at the gate
        self._abort_epoch = 0
        self._queue: list[_Row] = []
        self._running: list[_Row] = []
        self._batch_done = asyncio.Event()
        self._wake = asyncio.Event()
        self._batcher = self._runtime.submit(self._batch_loop())

    @property
    def is_paused(self) -> bool:
        return self._mode is not None

    def _vocab_size(self) -> int | None:
        return int(self.model.config.vocab_size)

    # -- requests and micro-batches ------------------------------------------------------
    async def _generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        if len(prompt) + params.max_tokens > self._max_len:
            raise EngineError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's {self._max_len} positions; shorten the prompt or lower max_tokens"
            )
        row = _Row(prompt, params, self._eos)
        self._queue.append(row)
        self._wake.set()
        try:
            return await row.fut
        except asyncio.CancelledError:
            if row in self._queue:
                self._queue.remove(row)
            raise

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._mode is not None or not self._queue:
                continue
            if self.batch_window_s > 0 and len(self._queue) < self.max_batch_size:
                await asyncio.sleep(self.batch_window_s)
            if self._mode is not None:
                continue
            batch = self._queue[: self.max_batch_size]
            del self._queue[: len(batch)]
            batch = [r for r in batch if not r.fut.done()]
            if self._queue:
                self._wake.set()
            if not batch:
                continue
            self._running = batch
            self._batch_done.clear()
            self.num_batches += 1
            try:
                results = await loop.run_in_executor(
                    self._worker, self._run_batch, batch, self._abort_epoch
                )
            except Exception as e:
                err = e if isinstance(e, EngineError) else EngineError(f"generate failed: {e!r}")
                for row in batch:
                    if not row.fut.done():
                        row.fut.set_exception(err)
            else:
                for row, gen in zip(batch, results, strict=True):
                    if not row.fut.done():
                        row.fut.set_result(gen)
            finally:
                self._running = []
                self._batch_done.set()

    def _run_batch(self, rows: list[_Row], epoch: int) -> list[Generation]:
        """Worker thread: one left-padded generate call for ``rows``."""
        from transformers import (
            GenerationConfig,
            LogitsProcessor,
            LogitsProcessorList,
            StoppingCriteria,
            StoppingCriteriaList,
        )

        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
            if not r.params.greedy:
                r.gen = torch.Generator()
                seed = r.params.seed
                r.gen.manual_seed(seed if seed is not None else int(torch.seed()) & 0x7FFFFFFF)
        step_versions: list[int] = []
        engine = self

        class Sampler(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                step_versions.append(engine._version)
                out = scores.clone()
                for i, r in enumerate(rows):
                    if r.gen is None or r.done is not None:
                        continue
                    tok = _sample_row(scores[i], r.params, r.gen)
                    out[i].fill_(float("-inf"))
                    out[i, tok] = 0.0
                return out

        class Stopper(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
                n = input_ids.shape[1] - width
                last = input_ids[:, -1].tolist()
                for i, r in enumerate(rows):
                    if r.done is None:
                        if last[i] in r.stop:
                            r.done = (n, "stop")
                        elif n >= r.params.max_tokens:
                            r.done = (n, "length")
                if not engine._gate.is_set():
                    engine._parked.set()
                    engine._gate.wait()
                    engine._parked.clear()
                if engine._abort_epoch != epoch:
                    for r in rows:
                        if r.done is None:
                            r.done = (n, "abort")
                return torch.tensor([r.done is not None for r in rows], device=input_ids.device)

        cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(r.params.max_tokens for r in rows),
            pad_token_id=self._pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=cfg,
                logits_processor=LogitsProcessorList([Sampler()]),
                stopping_criteria=StoppingCriteriaList([Stopper()]),
            )
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, 1).float().cpu()  # [B, T, V]
        results = []
        for i, r in enumerate(rows):
            n, reason = r.done if r.done is not None else (new.shape[1], "length")
            toks = new[i, :n]
            lps: list[float] = []
            if r.params.logprobs:
                lp = torch.log_softmax(logits[i, :n], -1).gather(-1, toks[:, None])[:, 0]
                lps = lp.tolist()
            results.append(Generation(toks.tolist(), lps, reason, step_versions[:n]))
        return results

    # -- pause / resume / weights --------------------------------------------------------
    async def _quiesce(self) -> None:
        """Close the gate and wait until the running generate is parked (or none runs)."""
        self._gate.clear()
        while self._running and not self._parked.is_set() and not self._batch_done.is_set():
            await asyncio.sleep(0.001)

    async def _pause(self, mode: PauseMode) -> None:
        self._mode = mode
        if mode == "keep":
            await self._quiesce()
        elif mode == "abort":
            self._abort_epoch += 1
            queued, self._queue = self._queue, []
            for row in queued:
                if not row.fut.done():
                    row.fut.set_result(Generation((), (), "abort", ()))
            self._gate.set()
            if self._running:
                await self._batch_done.wait()
        elif self._running:  # wait
            await self._batch_done.wait()

    async def _resume(self) -> None:
        self._mode = None
        self._gate.set()
        self._wake.set()

    async def _load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        await self._quiesce()
        try:
            own = self.model.state_dict()
            unknown = [n for n, _ in named if n not in own]
            if unknown:
                raise EngineError(
                    f"update_weights: {len(unknown)} names are not parameters of the model, "
                    f"e.g. {unknown[:3]}; pass the HF (transformers) parameter names"
                )
            with torch.no_grad():
                for name, tensor in named:
                    if own[name].shape != tensor.shape:
                        raise EngineError(
                            f"update_weights: {name} has shape {tuple(tensor.shape)}, the model "
                            f"expects {tuple(own[name].shape)}"
                        )
                    own[name].copy_(tensor)
            self._version = version
        finally:
            if self._mode != "keep":
                self._gate.set()

    async def _shutdown(self) -> None:
        self._mode = "closed"
        self._abort_epoch += 1
        err = EngineClosedError("HFEngine was closed")
        for row in self._queue:
            if not row.fut.done():
                row.fut.set_exception(err)
        self._queue = []
        self._gate.set()
        if self._running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._batch_done.wait(), timeout=30)
        self._batcher.cancel()

    def _after_close(self) -> None:
        self._gate.set()
        self._worker.shutdown(wait=True, cancel_futures=True)
