"""HFBackend: micro-batches of transformers decoding, driven step by step from the loop.

Requests arriving within ``batch_window_s`` of the first waiting one (or until
``max_batch_size`` wait) form one micro-batch (``hf_batch.DecodeBatch``). Each forward
step runs on one worker thread; between two steps the loop handles what changed: a
pause (``keep`` holds the batch, ``abort`` ends it, ``wait`` lets it finish), a weight
update (it waits for the step in flight only) and close. Nothing polls: the decode
task sleeps on an event that every change sets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import torch

from rollpipe.engines.backend import EngineLink
from rollpipe.engines.hf_batch import DecodeBatch, Row, logits_kwargs
from rollpipe.engines.hf_images import ImageDecode, ImageRow, VisionModel
from rollpipe.engines.protocol import OnTokens, PauseMode
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.threads import set_thread_torch_threads

__all__ = ["HFBackend"]


class HFBackend:
    """A transformers causal LM behind the backend contract.

    ``queue`` holds requests not yet in a batch; ``num_batches`` counts micro-batches.
    Each decode step reports its tokens through ``EngineLink.produced``. With a
    ``VisionModel`` (a vision-language model) it also takes images: an image request
    decodes alone (``hf_images``), and no request samples a vision token.
    """

    reports_tokens = True
    features = frozenset({"top_logprobs"})

    def __init__(
        self,
        model: Any,
        link: EngineLink,
        *,
        eos: frozenset[int],
        pad: int,
        max_len: int,
        device: torch.device,
        batch_window_s: float,
        max_batch_size: int,
        threads: int | None,
        vision: VisionModel | None = None,
    ) -> None:
        self.model = model
        self.link = link
        self.vocab_size: int | None = int(model.config.get_text_config().vocab_size)
        self.vision_model = vision
        self.vision = vision.tokens if vision is not None else None
        self.banned = None if vision is None else torch.tensor(vision.tokens.banned, device=device)
        if vision is not None:
            self.features = HFBackend.features | {"images"}
        self.no_images = (
            "its model reads text only (its config.json has no vision_config with an image "
            "token id); load a vision-language model"
        )
        self.eos, self.pad, self.max_len, self.device = eos, pad, max_len, device
        self.batch_window_s = batch_window_s
        self.max_batch_size = max_batch_size
        self.extra = logits_kwargs(model)
        self.worker = concurrent.futures.ThreadPoolExecutor(
            1, "rollpipe-hf-generate", initializer=set_thread_torch_threads, initargs=(threads,)
        )
        self.queue: list[Row] = []
        self.batch: DecodeBatch | None = None
        self.num_batches = 0
        self.closed = False
        self.abort_epoch = 0  # bumped by pause("abort") and close: the batch ends
        self.changed = asyncio.Event()  # set on every change the decode task waits for
        self.model_lock = asyncio.Lock()  # held by each step and each weight load
        self.batch_done = asyncio.Event()  # no batch is running
        self.batch_done.set()
        self.task = asyncio.get_running_loop().create_task(self._run())

    @classmethod
    async def start(cls, model: Any, link: EngineLink, **kwargs: Any) -> HFBackend:
        return cls(model, link, **kwargs)  # on the loop: the decode task starts there

    # -- requests ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        on_tokens: OnTokens = None,  # never called: BaseEngine delivers the ids at the end
        *,
        images: tuple[Any, ...] | None = None,
    ) -> Generation:
        if len(prompt) + params.max_tokens > self.max_len:
            raise EngineError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's {self.max_len} positions; shorten the prompt or lower max_tokens"
            )
        now = asyncio.get_running_loop().time()
        if images:
            row: Row = ImageRow(prompt, params, self.eos, now, images)
        else:
            row = Row(prompt, params, self.eos, now)
        self.queue.append(row)
        self.changed.set()
        try:
            return await row.fut
        except asyncio.CancelledError:  # a running row is dropped before the next step
            if row in self.queue:
                self.queue.remove(row)
            raise

    # -- the decode task -----------------------------------------------------------------
    async def _next_change(self) -> None:
        self.changed.clear()
        await self.changed.wait()

    async def _run(self) -> None:
        while not self.closed:
            if self.link.pause_mode() is not None or not self.queue:
                await self._next_change()
                continue
            await self._window()
            rows = self._take()
            if rows:
                await self._decode(rows)

    async def _window(self) -> None:
        """Wait until ``batch_window_s`` after the oldest waiting request arrived, or
        until a full batch waits (woken by each arrival, not polling)."""
        loop = asyncio.get_running_loop()
        while self.queue and len(self.queue) < self.max_batch_size and not self.closed:
            left = self.queue[0].arrived + self.batch_window_s - loop.time()
            if left <= 0 or self.link.pause_mode() is not None:
                return
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> list[Row]:
        if self.closed or self.link.pause_mode() is not None:
            return []
        batch = self.queue[: self.max_batch_size]
        if self.vision is not None:  # an image request decodes alone (its own positions)
            first = next((i for i, r in enumerate(batch) if isinstance(r, ImageRow)), None)
            batch = batch if first is None else batch[:first] or batch[:1]
        del self.queue[: len(batch)]
        return [r for r in batch if not r.fut.done()]

    async def _decode(self, rows: list[Row]) -> None:
        """Decode one micro-batch to its end, one step at a time."""
        loop = asyncio.get_running_loop()
        if isinstance(rows[0], ImageRow):
            assert self.vision_model is not None
            args = (self.model, rows, self.pad, self.device, self.extra, self.vision_model)
            batch: DecodeBatch = ImageDecode(*args)
        else:
            batch = DecodeBatch(
                self.model, rows, self.pad, self.device, self.extra, banned=self.banned
            )
        self.batch = batch
        self.batch_done.clear()
        self.num_batches += 1
        epoch = self.abort_epoch
        try:
            while live := [r for r in batch.rows if not r.fut.done()]:
                if self.abort_epoch != epoch:  # pause("abort") or close
                    for row in live:
                        row.finish("abort")
                    return
                if self.link.pause_mode() == "keep":
                    await self._next_change()
                    continue
                async with self.model_lock:
                    if self.abort_epoch != epoch or self.link.pause_mode() == "keep":
                        continue  # changed while a weight load held the model
                    version = self.link.version()
                    finished = await loop.run_in_executor(self.worker, batch.step, live, version)
                self.link.produced(len(live))  # one token per row
                for row in finished:
                    row.finish(row.reason or "length")
        except Exception as e:
            error = e if isinstance(e, EngineError) else EngineError(f"generate failed: {e!r}")
            for row in batch.rows:
                row.fail(error)
        finally:
            self.batch = None
            self.batch_done.set()

    # -- control -------------------------------------------------------------------------
    async def pause(self, mode: PauseMode) -> None:
        self.changed.set()
        if mode == "keep":
            async with self.model_lock:  # the step in flight has ended; none starts now
                return
        if mode == "abort":
            self.abort_epoch += 1
            queued, self.queue = self.queue, []
            for row in queued:
                row.finish("abort")
        await self.batch_done.wait()

    async def resume(self) -> None:
        self.changed.set()

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        own = self.model.state_dict()
        unknown = [n for n, _ in named if n not in own]
        if unknown:
            raise EngineError(
                f"update_weights: {len(unknown)} names are not parameters of the model, "
                f"e.g. {unknown[:3]}; pass the HF (transformers) parameter names"
            )
        for name, tensor in named:
            if own[name].shape != tensor.shape:
                raise EngineError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(own[name].shape)}"
                )

        def copy() -> None:
            with torch.no_grad():
                for name, tensor in named:
                    own[name].copy_(tensor)

        async with self.model_lock:  # waits for the step in flight only
            await asyncio.get_running_loop().run_in_executor(self.worker, copy)

    async def shutdown(self, error: BaseException) -> None:
        self.closed = True
        self.abort_epoch += 1
        self.changed.set()
        for row in [*self.queue, *(self.batch.rows if self.batch else [])]:
            row.fail(error)
        self.queue = []
        async with self.model_lock:  # the step in flight has ended
            self.task.cancel()

    def release(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)
