"""ServerBackend: a running vLLM OpenAI-compatible server, reached over HTTP with aiohttp.

Token ids go in and come out as they are (no re-tokenization). Requests use vLLM's
token-in/token-out ``POST /inference/v1/generate`` when the server offers it (``vllm
serve --enable-scale-out``; its answer carries the server's per-token weight-version
spans), else ``POST /v1/completions`` with a token-id prompt and ``return_token_ids``.
Pause keep, server-side abort and weight updates use the endpoints vLLM 0.32 adds with
``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``, ``/is_paused``,
``/update_weight_version``, ``/collective_rpc``, ``/reset_prefix_cache``. What the server
lacks raises ``EngineError`` saying "not supported by this server" and naming the endpoint.

Weights reach the server as a safetensors file that its worker reads:
``/collective_rpc`` runs the worker's ``reload_weights(weights_path=DIR)`` (an RPC carries
strings only, never tensors), so the server must see ``DIR`` at the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch

from rollpipe.engines.backend import EngineLink
from rollpipe.engines.protocol import PauseMode
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.server_client import ServerClient
from rollpipe.engines.server_weights import is_local, write_weights
from rollpipe.engines.vllm_common import finish_reason

__all__ = ["GENERATE", "ROUTES", "ServerBackend", "ServerOptions"]

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
ROUTES = ("auto", "generate", "completions")
ABORT_GRACE_S = 2.0  # after /pause?mode=abort, how long aborted answers may take to arrive
CONTROL_TIMEOUT_S = 600.0  # one pause, resume or weight-reload call
PROBE_TIMEOUT_S = 30.0  # one look-up when the engine starts
_ABORTED = Generation((), (), "abort", ())


@attrs.frozen
class ServerOptions:
    """How a ``ServerEngine`` uses its server (see ``ServerEngine`` for each field)."""

    model: str | None = None
    route: str = "auto"
    server_control: bool = True
    weights_dir: Path | None = None
    connect_timeout_s: float = 30.0
    update_weights_timeout_s: float | None = None


@attrs.define
class _Call:
    """One request on the wire; ``aborted``: a pause cancelled it."""

    task: asyncio.Task[Generation]
    aborted: bool = False


def _span_versions(spans: Any, n: int) -> list[int] | None:
    """Per-token versions from the server's weight-version spans (None if unusable)."""
    if not spans or spans[-1].get("end") != n:
        return None
    try:
        return [int(s["version"]) for s in spans for _ in range(s["end"] - s["start"])]
    except (KeyError, TypeError, ValueError):  # a label we did not set ("default")
        return None


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's outcome, so an abandoned one logs no "never retrieved"."""
    if not task.cancelled():
        task.exception()


def _message(body: Any) -> str:
    """The error message in a vLLM / FastAPI error body."""
    err = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    return str(err.get("message", err) if isinstance(err, dict) else err)[:1000]


class ServerBackend:
    """One vLLM server behind the backend contract; every coroutine runs on the engine's loop.

    ``inflight``: requests on the wire; ``held``: requests that arrived while paused,
    released by resume (True) or ended by an abort (False).
    """

    vocab_size: int | None = None  # the server checks ids ("Token id N is out of vocabulary")

    def __init__(self, client: ServerClient, link: EngineLink, options: ServerOptions) -> None:
        self.client, self.url, self.link, self.options = client, client.url, link, options
        self.model = ""
        self.max_model_len: int | None = None
        self.vllm_version = "unknown"
        self.route = "completions"
        self.endpoints: frozenset[str] = frozenset()
        self.inflight: dict[str, _Call] = {}
        self.held: list[asyncio.Future[bool]] = []
        self.idle = asyncio.Event()
        self.idle.set()
        self.server_paused = False  # this engine paused the server and owes it a /resume
        self.weights_dir = options.weights_dir
        self.own_weights_dir = False  # a temporary directory this backend made (and removes)
        self.loaded: Path | None = None  # the weights directory the server loaded last
        self._ids = itertools.count()
        self._prefix = f"rollpipe-{secrets.token_hex(4)}"

    @classmethod
    async def start(cls, url: str, link: EngineLink, options: ServerOptions) -> ServerBackend:
        backend = cls(ServerClient(url, options.connect_timeout_s, link.on_death), link, options)
        try:
            await backend._probe()
        except BaseException:
            await backend.client.close()
            raise
        return backend

    # -- HTTP ----------------------------------------------------------------------------
    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """An HTTP call that must succeed; raises EngineError naming the endpoint."""
        status, body = await self.client.request(method, path, **kwargs)
        if status >= 400:
            raise EngineError(
                f"vLLM server at {self.url}: {method} {path} failed with HTTP {status}: "
                f"{_message(body)}"
            )
        return body

    def _require(self, endpoint: str, purpose: str) -> None:
        """Raise "not supported by this server" unless the server offers ``endpoint``."""
        if endpoint in self.endpoints:
            return
        reason, hint = (
            f"has no {endpoint}",
            "start the server with VLLM_SERVER_DEV_MODE=1 (start_vllm_server does)",
        )
        if endpoint == GENERATE:
            hint = "start it with --enable-scale-out or use route='completions'"
        elif not self.options.server_control:
            reason = f"may not use {endpoint} (server_control=False)"
            hint = "build the engine with server_control=True"
        raise EngineError(f"{purpose} is not supported by this server: {self.url} {reason}; {hint}")

    async def _probe(self) -> None:
        """Learn the model, the route and the control endpoints the server offers."""
        t = PROBE_TIMEOUT_S
        models = (await self._call("GET", "/v1/models", timeout=t)).get("data") or []
        names = [m.get("id") for m in models]
        wanted = self.options.model
        if not models or (wanted is not None and wanted not in names):
            raise EngineError(
                f"vLLM server at {self.url} serves {names}, not model={wanted!r}; "
                "pass model= one of those names (or None for the first)"
            )
        entry = models[names.index(wanted)] if wanted is not None else models[0]
        self.model = str(entry["id"])
        self.max_model_len = entry.get("max_model_len")
        status, body = await self.client.request("GET", "/version", timeout=t)
        if status == 200 and isinstance(body, dict):
            self.vllm_version = str(body.get("version", "unknown"))
        found: set[str] = set()
        if self.options.route != "completions":
            status, _ = await self.client.request("POST", GENERATE, json={}, timeout=t)
            if status not in (403, 404, 405):  # a validation error: the route is there
                found.add(GENERATE)
        if self.options.server_control:
            if (await self.client.request("GET", "/is_paused", timeout=t))[0] == 200:
                found |= {"/pause", "/resume", "/update_weight_version"}
            if (await self.client.request("GET", "/collective_rpc", timeout=t))[
                0
            ] == 405:  # POST only
                found |= {"/collective_rpc", "/reset_prefix_cache"}
        self.endpoints = frozenset(found)
        if self.options.route == "generate":
            self._require(GENERATE, "route='generate'")
        self.route = "generate" if GENERATE in found else "completions"
        if "/update_weight_version" in found:  # the spans then carry rollpipe's versions
            await self._call(
                "POST", "/update_weight_version", json={"new_version": str(self.link.version())}
            )

    # -- requests ------------------------------------------------------------------------
    async def generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        if self.max_model_len is not None and len(prompt) >= self.max_model_len:
            raise EngineError(
                f"prompt has {len(prompt)} tokens but the server's max_model_len is "
                f"{self.max_model_len}; shorten the prompt or restart the server with a "
                "larger --max-model-len"
            )
        while self.link.pause_mode() is not None:
            if not await self._hold():
                return _ABORTED
        rid = f"{self._prefix}-{next(self._ids)}"
        call = _Call(asyncio.ensure_future(self._complete(rid, prompt, params)))
        self.inflight[rid] = call
        self.idle.clear()
        try:
            return await call.task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if call.aborted and (me is None or not me.cancelling()):
                return _ABORTED  # the pause cancelled the request, not our caller
            raise  # cancelling the task closed its connection: the server aborts it
        finally:
            del self.inflight[rid]
            if not self.inflight:
                self.idle.set()

    def _answer_held(self, outcome: bool | BaseException) -> None:
        """Release the held requests: resume (True), abort (False) or the engine's death."""
        held, self.held = self.held, []
        for fut in (f for f in held if not f.done()):
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    async def _hold(self) -> bool:
        """Wait for resume (True) or an abort (False)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.held.append(fut)
        try:
            return await fut
        finally:
            with contextlib.suppress(ValueError):
                self.held.remove(fut)

    def _sampling(self, params: SamplingParams) -> dict[str, Any]:
        return {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "seed": params.seed,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
            "logprobs": 0 if params.logprobs else None,
            "skip_special_tokens": False,
        }

    async def _complete(self, rid: str, prompt: list[int], params: SamplingParams) -> Generation:
        version = self.link.version()
        if self.route == "generate":
            sampling = self._sampling(params) | {"detokenize": False}
            payload = {"request_id": rid, "token_ids": prompt, "sampling_params": sampling}
            path = GENERATE
        else:
            payload = self._sampling(params) | {
                "model": self.model,
                "prompt": prompt,
                "return_token_ids": True,
                "request_id": rid,
            }
            path = COMPLETIONS
        body = await self._call("POST", path, json=payload)
        try:
            choice = body["choices"][0]
            tokens = list(choice["token_ids"] or [])
            logprobs: list[float] = []
            if params.logprobs and tokens:
                lp = choice["logprobs"]
                logprobs = (
                    [float(e["logprob"]) for e in lp["content"]]
                    if path == GENERATE
                    else [float(x) for x in lp["token_logprobs"]]
                )
            spans = None  # the server's labels are ours only if this engine sets them
            if "/update_weight_version" in self.endpoints:
                spans = _span_versions(choice.get("weight_versions"), len(tokens))
            versions = spans or [version] * len(tokens)
            return Generation(tokens, logprobs, finish_reason(choice["finish_reason"]), versions)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"unexpected answer from {self.url}{path}: {e!r}") from e

    # -- control -------------------------------------------------------------------------
    async def _server_pause(self, mode: PauseMode) -> None:
        self._require("/pause", f"pause({mode!r})")
        params = {"mode": mode, "clear_cache": "false"}
        await self._call("POST", "/pause", params=params, timeout=CONTROL_TIMEOUT_S)
        self.server_paused = True

    async def _server_resume(self) -> None:
        await self._call("POST", "/resume", timeout=CONTROL_TIMEOUT_S)
        self.server_paused = False

    async def pause(self, mode: PauseMode) -> None:
        if mode == "keep":
            await self._server_pause("keep")
            return
        if mode == "wait":
            if self.server_paused:  # paused with keep before: let the frozen ones finish
                await self._server_resume()
            await self.idle.wait()
            return
        if "/pause" in self.endpoints:  # aborted requests answer with their partial tokens
            await self._server_pause("abort")
            if self.inflight:
                await asyncio.wait([c.task for c in self.inflight.values()], timeout=ABORT_GRACE_S)
        for call in list(self.inflight.values()):  # the rest: close the connection
            if not call.task.done():
                call.aborted = True
                call.task.cancel()
        self._answer_held(False)
        await self.idle.wait()

    async def resume(self) -> None:
        try:
            if self.server_paused:
                await self._server_resume()
        finally:
            self._answer_held(True)

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        self._require("/collective_rpc", "update_weights")
        if self.weights_dir is None and is_local(self.url):
            self.weights_dir = Path(tempfile.mkdtemp(prefix="rollpipe-weights-"))
            self.own_weights_dir = True
        if self.weights_dir is None:
            raise EngineError(
                f"update_weights is not supported by this server without shared storage: "
                f"{self.url} is not on this machine, and the server reads new weights from "
                "a file; pass weights_dir= a directory the server sees at the same path"
            )
        target = self.weights_dir / f"v{version}-{next(self._ids)}"
        write_weights(named, target)  # on the loop: the step in flight is unaffected
        # The reload runs as its own task so that a server that never answers cannot hold
        # this call past the limit (the task's cleanup may wait on the server too).
        sync = asyncio.ensure_future(self._reload(target, version))
        sync.add_done_callback(_consume)
        try:
            done, _ = await asyncio.wait({sync}, timeout=self.options.update_weights_timeout_s)
        except BaseException:
            sync.cancel()
            raise
        if not done:
            sync.cancel()
            error = EngineError(
                f"ServerEngine at {self.url}: update_weights to version {version} did not "
                f"finish within update_weights_timeout_s={self.options.update_weights_timeout_s}"
                " s; this engine is dead (create a new one once the server answers again). "
                "Check the server's log for what stalled, or raise update_weights_timeout_s "
                "for a model whose weights take longer to load"
            )
            self.link.on_death(error)
            raise error
        sync.result()
        previous, self.loaded = self.loaded, target
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    async def _reload(self, target: Path, version: int) -> None:
        """Pause (keep), have the worker reload ``target``, relabel, resume."""
        paused_here = not self.server_paused
        try:
            if paused_here:
                await self._server_pause("keep")
            try:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(target)}}
                await self._call("POST", "/collective_rpc", json=rpc, timeout=CONTROL_TIMEOUT_S)
                # Running requests are preempted and recomputed under the new weights.
                await self._call(
                    "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}
                )
                await self._call(
                    "POST", "/update_weight_version", json={"new_version": str(version)}
                )
            finally:
                if paused_here and self.server_paused:
                    await self._server_resume()
        except Exception:  # not when cancelled: a stalled server may read the file later
            shutil.rmtree(target, ignore_errors=True)
            raise

    async def shutdown(self, error: BaseException) -> None:
        self._answer_held(error)
        for call in self.inflight.values():
            call.task.cancel()  # closes the connection: the server aborts the request
        try:
            if self.server_paused:  # never leave the server paused for its other clients
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._server_resume(), 5)
        finally:
            await self.client.close()

    def release(self) -> None:
        mine = self.weights_dir if self.own_weights_dir else self.loaded
        if mine is not None:  # never a user's weights_dir, only what this backend wrote
            shutil.rmtree(mine, ignore_errors=True)
