"""InprocBackend: an in-process vLLM ``LLMEngine``, stepped by a task on the engine's loop.

A step blocks the loop for one forward pass; requests, pauses and weight updates are
handled between steps, so every token carries the version of the weights that produced
it and nothing needs a lock. An idle stepper sleeps on an event until a request arrives.

On CPU, the in-process engines of one process run their forward passes one at a time
(``CPU_FORWARD_LOCK``): vLLM's CPU attention kernels keep scratch buffers per OpenMP
thread number, shared by every engine in the process, and two engines stepping at once
from two threads corrupted the heap here (``free(): invalid next size``). Engines that
must compute in parallel on CPU use ``multiprocess=True`` (one engine core per process).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Iterator
from typing import Any

import torch

from rollpipe.engines.backend import EngineLink
from rollpipe.engines.images import VisionTokens
from rollpipe.engines.protocol import OnTokens, PauseMode
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.threads import set_thread_torch_threads
from rollpipe.engines.vllm_common import (
    VLLMBackendBase,
    finish_reason,
    reload_weights_on_worker,
    sampled_logprobs,
    top_logprobs,
)

__all__ = ["BURST_GAP_S", "BURST_MAX_S", "CPU_FORWARD_LOCK", "InprocBackend"]

CPU_FORWARD_LOCK = threading.Lock()
"""Held by an in-process CPU engine while it builds or steps (see the module doc)."""

BURST_GAP_S = 0.002  # an idle engine starts once no request arrived for this long...
BURST_MAX_S = 0.02  # ...or this long after the first one, whichever comes first


class _Request:
    """One request and what it produced so far."""

    __slots__ = (
        "cached_tokens",
        "expanded",
        "fut",
        "images",
        "logprobs",
        "on_tokens",
        "prompt",
        "rid",
        "sp",
        "tokens",
        "top",
        "top_k",
        "versions",
        "want_lp",
    )

    def __init__(
        self,
        rid: str,
        prompt: list[int],
        sp: Any,
        params: SamplingParams,
        on_tokens: OnTokens,
        images: tuple[Any, ...] | None = None,
    ) -> None:
        self.rid, self.prompt, self.sp, self.images = rid, prompt, sp, images
        self.want_lp, self.top_k, self.on_tokens = params.logprobs, params.top_logprobs, on_tokens
        self.fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[tuple[tuple[int, float], ...]] = []
        self.versions: list[int] = []
        self.cached_tokens: int | None = None
        self.expanded: list[int] | None = None  # the prompt vLLM reports (with images)

    def finish(self, reason: str) -> None:
        if not self.fut.done():
            gen = Generation(
                self.tokens,
                self.logprobs,
                reason,
                self.versions,
                self.cached_tokens,
                self.top,
                self.expanded,
            )
            self.fut.set_result(gen)

    def fail(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)


@contextlib.contextmanager
def _preserved_global_rng() -> Iterator[None]:
    """Restore Python's, numpy's and torch's global RNGs (in-process vLLM seeds them)."""
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


@contextlib.contextmanager
def _keep_distributed_state() -> Iterator[None]:
    """Skip vLLM's teardown of the process-wide distributed state for one shutdown.

    In-process engines share torch.distributed / model-parallel groups; EngineCore's
    shutdown destroys them, which would kill every other in-process engine.
    """
    import vllm.v1.engine.core as core

    original = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = original


class InprocBackend(VLLMBackendBase):
    """An in-process ``LLMEngine``; ``active`` requests step, ``queued`` ones wait for resume."""

    live = 0  # in-process engines alive in this process (they share distributed state)

    def __init__(
        self,
        llm: Any,
        link: EngineLink,
        forward_lock: contextlib.AbstractContextManager[Any],
        vision: VisionTokens | None = None,
    ) -> None:
        super().__init__(llm, link, vision)
        self.forward_lock = forward_lock
        self.active: dict[str, _Request] = {}
        self.queued: list[_Request] = []
        self.wake = asyncio.Event()  # there may be work for the stepper
        self.arrived = asyncio.Event()  # a request was added (ends a burst's gap early)
        self.idle = asyncio.Event()  # no active request
        self.idle.set()
        self.stepper = asyncio.get_running_loop().create_task(self._step_loop())

    @classmethod
    async def start(
        cls, args: Any, link: EngineLink, threads: int | None, vision: VisionTokens | None = None
    ) -> InprocBackend:
        from vllm.v1.engine.llm_engine import LLMEngine

        on_cpu = threads is not None  # VLLMEngine resolves threads on CPU only
        forward_lock = CPU_FORWARD_LOCK if on_cpu else contextlib.nullcontext()
        set_thread_torch_threads(threads)
        with forward_lock, _preserved_global_rng():
            llm = LLMEngine.from_engine_args(args)
        set_thread_torch_threads(threads)  # the CPU worker patched the setter; undo, re-apply
        llm.set_weight_version(str(link.version()))
        InprocBackend.live += 1
        return cls(llm, link, forward_lock, vision)

    # -- requests ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        on_tokens: OnTokens = None,
        *,
        images: tuple[Any, ...] | None = None,
    ) -> Generation:
        rid, sp = self.request(prompt, params)
        req = _Request(rid, prompt, sp, params, on_tokens, images)
        if self.link.pause_mode() is None:
            self._add(req)
        else:
            self.queued.append(req)
        try:
            return await req.fut
        except asyncio.CancelledError:
            self._drop(req)
            raise

    def _add(self, req: _Request) -> None:
        try:
            self.llm.add_request(req.rid, self.prompt(req.prompt, req.images), req.sp)
        except Exception as e:
            raise EngineError(f"vLLM rejected request {req.rid}: {e}") from e
        self.active[req.rid] = req
        self.idle.clear()
        self.arrived.set()
        self.wake.set()

    def _drop(self, req: _Request) -> None:
        if req in self.queued:
            self.queued.remove(req)
        if self.active.pop(req.rid, None) is not None:
            self.llm.abort_request([req.rid])
            self._update_idle()

    def _update_idle(self) -> None:
        if not self.active:
            self.idle.set()

    # -- the stepper ---------------------------------------------------------------------
    async def _gather_burst(self) -> None:
        """After waking from idle, keep collecting while requests keep arriving (each
        within ``BURST_GAP_S`` of the last, ``BURST_MAX_S`` in all), so a burst of
        submissions (a whole wave of episodes starting their turn) is prefilled in one
        step rather than trickling into several small ones. Woken by each arrival."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BURST_MAX_S
        while (left := deadline - loop.time()) > 0:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), min(BURST_GAP_S, left))
            except TimeoutError:  # a gap with no arrival: the burst is over
                return

    def _stalled(self) -> bool:
        return not self.active or self.link.pause_mode() in ("keep", "abort")

    async def _step_loop(self) -> None:
        while True:
            if self._stalled():
                self.wake.clear()
                await self.wake.wait()
                await self._gather_burst()
                continue
            try:
                with self.forward_lock:
                    outputs = self.llm.step()
                version = self.link.version()
                self.link.produced(sum(len(out.outputs[0].token_ids) for out in outputs))
                for out in outputs:
                    req = self.active.get(out.request_id)
                    if req is not None:
                        self._on_output(req, out, version)
            except Exception as e:  # never leave requests waiting on a dead stepper
                self._die(e)
                return
            self._update_idle()
            # One pass of the loop between steps (not a wait): submissions, pauses and
            # weight updates scheduled meanwhile run before the next step.
            await asyncio.sleep(0)

    def _on_output(self, req: _Request, out: Any, version: int) -> None:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        req.tokens.extend(ids)
        req.versions.extend([version] * len(ids))
        if req.want_lp and ids:
            req.logprobs.extend(sampled_logprobs(ids, comp.logprobs))
        if req.top_k and ids:
            req.top.extend(top_logprobs(comp.logprobs, req.top_k))
        if req.on_tokens is not None and ids:
            req.on_tokens(ids)
        if out.num_cached_tokens is not None:
            req.cached_tokens = out.num_cached_tokens
        if req.images and req.expanded is None and out.prompt_token_ids is not None:
            req.expanded = list(out.prompt_token_ids)
        if out.finished:
            del self.active[req.rid]
            try:
                req.finish(finish_reason(comp.finish_reason))
            except EngineError as e:
                req.fail(e)

    def _die(self, exc: BaseException) -> None:
        self.link.on_death(exc)
        err = EngineError(f"vLLM engine step failed: {exc!r}; the engine is unusable")
        for req in [*self.active.values(), *self.queued]:
            req.fail(err)
        self.active.clear()
        self.queued.clear()
        self.idle.set()

    # -- control -------------------------------------------------------------------------
    async def pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            ids = list(self.active)
            if ids:
                self.llm.abort_request(ids)
            for rid in ids:
                self.active.pop(rid).finish("abort")
            self.idle.set()
        elif mode == "wait":
            self.wake.set()
            await self.idle.wait()

    async def resume(self) -> None:
        queued, self.queued = self.queued, []
        for req in queued:
            try:
                self._add(req)
            except EngineError as e:
                req.fail(e)
        self.wake.set()

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        try:
            self.llm.collective_rpc(reload_weights_on_worker, kwargs={"weights": named})
            # Running requests are preempted and recomputed under the new weights.
            self.llm.reset_prefix_cache(reset_running_requests=True)
            self.llm.set_weight_version(str(version))
        except Exception as e:
            raise EngineError(f"vLLM weight update failed: {e!r}") from e

    async def shutdown(self, error: BaseException) -> None:
        self.stepper.cancel()
        for req in [*self.active.values(), *self.queued]:
            req.fail(error)
        if self.active:
            with contextlib.suppress(Exception):
                self.llm.abort_request(list(self.active))
        self.active.clear()
        self.queued.clear()
        InprocBackend.live -= 1
        others_alive = InprocBackend.live > 0
        try:
            with _keep_distributed_state() if others_alive else contextlib.nullcontext():
                self.llm.engine_core.shutdown()
        finally:
            self.llm = None

    def release(self) -> None:
        self.llm = None
        gc.collect()
