"""AsyncBackend: vLLM's ``AsyncLLM``, its engine core in a child process.

Requests stream DELTA outputs; pause maps to ``pause_generation``, and per-token versions
come from vLLM's weight-version spans. A dead engine core is reported to the engine
through ``EngineLink.on_death``.
"""

from __future__ import annotations

import asyncio
import gc
import io
import os
from typing import Any

import torch

from rollpipe.engines.backend import EngineLink
from rollpipe.engines.images import VisionTokens
from rollpipe.engines.protocol import OnTokens, PauseMode
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.vllm_common import (
    VLLMBackendBase,
    finish_reason,
    reload_weights_on_worker,
    sampled_logprobs,
    top_logprobs,
)

__all__ = ["AsyncBackend"]


def _span_versions(spans: Any, n: int) -> list[int] | None:
    """Per-token versions from vLLM's weight-version spans (None if unusable)."""
    if not spans or spans[-1].end != n:
        return None
    try:
        return [int(s.version) for s in spans for _ in range(s.end - s.start)]
    except ValueError:  # a label we did not set
        return None


class AsyncBackend(VLLMBackendBase):
    """``AsyncLLM`` behind the backend contract; ``inflight`` holds running request ids."""

    def __init__(self, llm: Any, link: EngineLink, vision: VisionTokens | None = None) -> None:
        super().__init__(llm, link, vision)
        self.inflight: set[str] = set()

    @classmethod
    async def start(
        cls, args: Any, link: EngineLink, threads: int | None, vision: VisionTokens | None = None
    ) -> AsyncBackend:
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
            await llm.update_weight_version(str(link.version()))
        except BaseException:
            llm.shutdown()
            raise
        return cls(llm, link, vision)

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        on_tokens: OnTokens = None,
        *,
        images: tuple[Any, ...] | None = None,
    ) -> Generation:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        rid, sp = self.request(prompt, params)
        tokens: list[int] = []
        logprobs: list[float] = []
        top: list[tuple[tuple[int, float], ...]] = []
        versions: list[int] = []
        final = None
        expanded: list[int] | None = None  # the prompt vLLM reports (with images)
        self.inflight.add(rid)
        try:
            request = TokensPrompt(**self.prompt(prompt, images))  # type: ignore[typeddict-item]
            stream = self.llm.generate(request, sp, request_id=rid)
            async for out in stream:
                if images and expanded is None and out.prompt_token_ids is not None:
                    expanded = list(out.prompt_token_ids)
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                tokens.extend(ids)
                self.link.produced(len(ids))
                versions.extend([self.link.version()] * len(ids))
                if params.logprobs and ids:
                    logprobs.extend(sampled_logprobs(ids, comp.logprobs))
                if params.top_logprobs and ids:
                    top.extend(top_logprobs(comp.logprobs, params.top_logprobs))
                if on_tokens is not None and ids:
                    on_tokens(ids)
                if out.finished:
                    final = comp
        except EngineDeadError as e:
            self.link.on_death(e)
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
        reason = finish_reason(final.finish_reason)
        return Generation(
            tokens, logprobs, reason, versions, top_logprobs=top, prompt_token_ids=expanded
        )

    async def pause(self, mode: PauseMode) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        running = self.link.pause_mode() is None
        if running:  # vLLM changes versions only while paused
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
            if running:
                await self.llm.resume_generation()

    async def shutdown(self, error: BaseException) -> None:
        try:
            if self.inflight:
                await asyncio.wait_for(self.llm.abort(list(self.inflight)), timeout=5)
        except Exception:
            pass
        finally:
            self.llm.shutdown()
            self.llm = None

    def release(self) -> None:
        self.llm = None
        gc.collect()
