"""An OpenEnv env server started on this machine: ``uvicorn module:app`` in a child process.

OpenEnv envs are FastAPI apps (``app = create_app(MyEnv, MyAction, MyObservation)``) that
clients reach over HTTP / WebSocket. ``shared_server(app)`` starts one server per app per
process, on a port the OS picks, and hands it to every adapter that names that app;
``release`` stops it when the last one lets go (and ``atexit`` stops any left). The
server is ready when uvicorn logs the address it listens on: that line is read from its
output (an event, not a poll), so a slow machine only waits longer.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import re
import subprocess
import sys
import threading

_LISTENING = re.compile(r"Uvicorn running on (http://\S+)")
_STOP_GRACE_S = 10.0


class ServerStartError(RuntimeError):
    """The server exited, or did not listen, before its startup limit."""


class LocalServer:
    """``uvicorn app`` on 127.0.0.1 in its own process; ``url`` once it listens.

    The child sees this process's ``sys.path`` (``PYTHONPATH``), so it imports the app
    module exactly as this process would.
    """

    def __init__(self, app: str, startup_timeout_s: float) -> None:
        self.app = app
        self.url = ""
        self._log: collections.deque[str] = collections.deque(maxlen=40)
        self._listening = threading.Event()
        paths = [p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        command = [sys.executable, "-m", "uvicorn", app, "--no-access-log"]
        self.process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        threading.Thread(target=self._read_log, name=f"openenv-log-{app}", daemon=True).start()
        if not self._listening.wait(startup_timeout_s):
            self.close()
            raise ServerStartError(
                f"OpenEnv app {app!r} was not listening after startup_timeout_s="
                f"{startup_timeout_s}; raise it, or read the server's log:\n{self.log_tail()}"
            )
        if not self.url:
            self.close()
            raise ServerStartError(
                f"OpenEnv app {app!r} exited (code {self.process.returncode}) before it "
                f"listened; is {app!r} a 'module:app' path to an OpenEnv FastAPI app "
                f"importable here? Its log ends with:\n{self.log_tail()}"
            )

    def _read_log(self) -> None:
        """Keep the server's output flowing (a full pipe would stall it); note its URL."""
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._log.append(line.rstrip())
            if not self.url and (match := _LISTENING.search(line)):
                self.url = match.group(1)
                self._listening.set()
        self.process.wait()
        self._listening.set()  # exited: wake a waiting start at once

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self) -> str:
        """The last lines the server logged."""
        return "\n".join(self._log)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a grace period); idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_LOCK = threading.Lock()
_SERVERS: dict[str, tuple[LocalServer, int]] = {}  # app -> (server, adapters using it)


def shared_server(app: str, startup_timeout_s: float) -> LocalServer:
    """The running server for ``app``, started if there is none (or it died)."""
    with _LOCK:
        server, users = _SERVERS.get(app, (None, 0))
        if server is None or not server.alive:
            if server is not None:
                server.close()
            server, users = LocalServer(app, startup_timeout_s), 0
        _SERVERS[app] = (server, users + 1)
        return server


def release(server: LocalServer) -> None:
    """One adapter is done with ``server``; the last one stops it."""
    with _LOCK:
        current, users = _SERVERS.get(server.app, (None, 0))
        if current is not server:
            server.close()
            return
        if users > 1:
            _SERVERS[server.app] = (server, users - 1)
            return
        del _SERVERS[server.app]
    server.close()


@atexit.register
def _stop_all() -> None:
    with _LOCK:
        servers = [server for server, _ in _SERVERS.values()]
        _SERVERS.clear()
    for server in servers:
        with contextlib.suppress(Exception):
            server.close()
