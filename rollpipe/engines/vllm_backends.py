"""The two vLLM process layouts behind ``VLLMEngine``; both run on the engine's loop.

``InprocBackend`` steps an in-process ``LLMEngine`` itself; ``AsyncBackend`` wraps
``AsyncLLM`` (engine core in a child process). See ``rollpipe.engines.vllm``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rollpipe.engines.base import EngineError, Generation, PauseMode, set_thread_torch_threads

if TYPE_CHECKING:
    from rollpipe.engines.vllm import VLLMEngine

__all__ = ["AsyncBackend", "InprocBackend", "VLLMBackend", "reload_weights_on_worker"]

_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
BURST_GAP_S = 0.002  # an idle engine starts once submissions pause this long...
BURST_MAX_S = 0.02  # ...or after this long, whichever comes first


def reload_weights_on_worker(
    worker: Any,
    weights: list[tuple[str, torch.Tensor]] | None = None,
    blob: bytes | None = None,
) -> bool:
    """Runs inside a vLLM worker: load HF-named weights into the live model in place.

    In-process the tensors arrive as they are; across processes they come as one
    ``torch.save`` blob (vLLM's RPC encoder cannot type tensors nested in kwargs).
    """
    if blob is not None:
        weights = torch.load(io.BytesIO(blob), weights_only=True)
    if weights is None:
        raise ValueError("reload_weights_on_worker needs weights or blob")
    worker.model_runner.reload_weights(weights_iterator=iter(weights))
    return True


def _sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    if logprobs is None:
        raise EngineError("vLLM returned no logprobs although the request asked for them")
    return [float(pos[tok].logprob) for tok, pos in zip(token_ids, logprobs, strict=True)]


def _finish_reason(reason: Any) -> str:
    mapped = _REASONS.get(str(reason))
    if mapped is None:
        raise EngineError(f"vLLM finished the request with reason {reason!r}")
    return mapped


def _span_versions(spans: Any, n: int) -> list[int] | None:
    """Per-token versions from vLLM's weight-version spans (None if unusable)."""
    if not spans or spans[-1].end != n:
        return None
    try:
        return [int(s.version) for s in spans for _ in range(s.end - s.start)]
    except ValueError:  # a label we did not set
        return None


@contextlib.contextmanager
def _preserved_global_rng() -> Iterator[None]:
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


class VLLMBackend(Protocol):
    vocab_size: int

    async def generate(self, rid: str, prompt: list[int], sp: Any, want_lp: bool) -> Generation: ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None: ...

    async def shutdown(self, exc: BaseException) -> None: ...


class _Request:
    __slots__ = ("fut", "logprobs", "prompt", "rid", "sp", "tokens", "versions", "want_lp")

    def __init__(self, rid: str, prompt: list[int], sp: Any, want_lp: bool) -> None:
        self.rid, self.prompt, self.sp, self.want_lp = rid, prompt, sp, want_lp
        self.fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def finish(self, reason: str) -> None:
        if not self.fut.done():
            self.fut.set_result(Generation(self.tokens, self.logprobs, reason, self.versions))

    def fail(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)


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


class InprocBackend:
    """An in-process ``LLMEngine`` stepped by a task on the engine loop.

    A step blocks the loop for one forward pass; requests, pauses and weight updates
    are handled between steps, so versions are exact and no locking is needed.
    """

    live = 0  # in-process engines alive in this process (they share distributed state)

    def __init__(self, llm: Any, owner: VLLMEngine) -> None:
        self.llm = llm
        self.owner = owner
        self.vocab_size = int(llm.model_config.get_vocab_size())
        self.active: dict[str, _Request] = {}
        self.queued: list[_Request] = []
        self.mode: str | None = None  # pause mode, None while running
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.stepper = asyncio.get_running_loop().create_task(self._step_loop())

    @classmethod
    async def start(cls, args: Any, owner: VLLMEngine, threads: int | None) -> InprocBackend:
        from vllm.v1.engine.llm_engine import LLMEngine

        set_thread_torch_threads(threads)
        with _preserved_global_rng():  # in-process vLLM seeds the global RNGs
            llm = LLMEngine.from_engine_args(args)
        set_thread_torch_threads(threads)  # the CPU worker patched the setter; undo, re-apply
        llm.set_weight_version(str(owner.version))
        InprocBackend.live += 1
        return cls(llm, owner)

    async def generate(self, rid: str, prompt: list[int], sp: Any, want_lp: bool) -> Generation:
        req = _Request(rid, prompt, sp, want_lp)
        if self.mode is None:
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
            self.llm.add_request(req.rid, {"prompt_token_ids": req.prompt}, req.sp)
        except Exception as e:
            raise EngineError(f"vLLM rejected request {req.rid}: {e}") from e
        self.active[req.rid] = req
        self.idle.clear()
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

    async def _gather_burst(self) -> None:
        """After waking from idle, wait while requests keep arriving (gaps under
        ``BURST_GAP_S``, at most ``BURST_MAX_S`` in all), so a burst of submissions — a
        whole wave of episodes starting their turn — is prefilled in one step rather
        than trickling into several small ones."""
        deadline = time.perf_counter() + BURST_MAX_S
        while time.perf_counter() < deadline:
            seen = len(self.active)
            await asyncio.sleep(BURST_GAP_S)
            if len(self.active) == seen:
                return

    async def _step_loop(self) -> None:
        while True:
            if not self.active or self.mode in ("keep", "abort"):
                self.wake.clear()
                await self.wake.wait()
                await self._gather_burst()
                continue
            try:
                outputs = self.llm.step()
                version = self.owner.version
                for out in outputs:
                    req = self.active.get(out.request_id)
                    if req is not None:
                        self._on_output(req, out, version)
            except Exception as e:  # never leave requests waiting on a dead stepper
                self._die(e)
                return
            self._update_idle()
            await asyncio.sleep(0)  # let submissions, pauses and updates in

    def _on_output(self, req: _Request, out: Any, version: int) -> None:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        req.tokens.extend(ids)
        req.versions.extend([version] * len(ids))
        if req.want_lp and ids:
            req.logprobs.extend(_sampled_logprobs(ids, comp.logprobs))
        if out.finished:
            del self.active[req.rid]
            try:
                req.finish(_finish_reason(comp.finish_reason))
            except EngineError as e:
                req.fail(e)

    def _die(self, exc: BaseException) -> None:
        self.owner.mark_dead(exc)
        err = EngineError(f"vLLM engine step failed: {exc!r}; the engine is unusable")
        for req in [*self.active.values(), *self.queued]:
            req.fail(err)
        self.active.clear()
        self.queued.clear()
        self.idle.set()

    async def pause(self, mode: PauseMode) -> None:
        self.mode = mode
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
        self.mode = None
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

    async def shutdown(self, exc: BaseException) -> None:
        self.stepper.cancel()
        for req in [*self.active.values(), *self.queued]:
            req.fail(exc)
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


class AsyncBackend:
    """vLLM's ``AsyncLLM``: engine core in a child process, streaming DELTA outputs."""

    def __init__(self, llm: Any, owner: VLLMEngine) -> None:
        self.llm = llm
        self.owner = owner
        self.vocab_size = int(llm.model_config.get_vocab_size())
        self.inflight: set[str] = set()

    @classmethod
    async def start(cls, args: Any, owner: VLLMEngine, threads: int | None) -> AsyncBackend:
        from vllm.v1.engine.async_llm import AsyncLLM

        old = os.environ.get("OMP_NUM_THREADS")
        if threads is not None:  # inherited by the spawned engine core only
            os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            llm = AsyncLLM.from_engine_args(args)
        finally:
            if threads is not None:
                if old is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = old
        try:
            await llm.update_weight_version(str(owner.version))
        except BaseException:
            llm.shutdown()
            raise
        return cls(llm, owner)

    async def generate(self, rid: str, prompt: list[int], sp: Any, want_lp: bool) -> Generation:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        final = None
        self.inflight.add(rid)
        try:
            stream = self.llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, request_id=rid)
            async for out in stream:
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                tokens.extend(ids)
                versions.extend([self.owner.version] * len(ids))
                if want_lp and ids:
                    logprobs.extend(_sampled_logprobs(ids, comp.logprobs))
                if out.finished:
                    final = comp
        except EngineDeadError as e:
            self.owner.mark_dead(e)
            raise EngineError(f"vLLM engine died: {e}") from e
        except (asyncio.CancelledError, EngineError):
            raise
        except Exception as e:
            raise EngineError(f"vLLM request {rid} failed: {e!r}") from e
        finally:
            self.inflight.discard(rid)
        if final is None:
            raise EngineError(f"vLLM request {rid} ended without a final output")
        versions = _span_versions(getattr(final, "weight_versions", None), len(tokens)) or versions
        return Generation(tokens, logprobs, _finish_reason(final.finish_reason), versions)

    async def pause(self, mode: PauseMode) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        was_paused = self.owner.is_paused
        if not was_paused:  # versions may only change while vLLM is paused
            await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            buf = io.BytesIO()
            torch.save([(n, t.cpu()) for n, t in named], buf)
            await self.llm.collective_rpc(reload_weights_on_worker, kwargs={"blob": buf.getvalue()})
            await self.llm.reset_prefix_cache(reset_running_requests=True)
            await self.llm.update_weight_version(str(version))
        except Exception as e:
            raise EngineError(f"vLLM weight update failed: {e!r}") from e
        finally:
            if not was_paused:
                await self.llm.resume_generation()

    async def shutdown(self, exc: BaseException) -> None:
        try:
            if self.inflight:
                await asyncio.wait_for(self.llm.abort(list(self.inflight)), timeout=5)
        except Exception:
            pass
        finally:
            self.llm.shutdown()
            self.llm = None
