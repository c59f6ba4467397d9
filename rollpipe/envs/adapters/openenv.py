"""OpenEnv (``openenv-core``) env servers as rollpipe envs: ``OpenEnvEnv(url=... | app=...)``.

An OpenEnv env runs as a server; the adapter is its client (OpenEnv's own
``GenericEnvClient``: one WebSocket session per adapter, kept across episodes). Give
either ``url``, a server already running (``http://host:port``), or ``app``, the import
path of the env's FastAPI app (``"my_env.server.app:app"``), which the adapter serves
on this machine (:mod:`~rollpipe.envs.adapters.openenv_server`: one server per app per
process, stopped when the last adapter using it closes).

The adapter is an ``AsyncTextEnv``: its calls are network I/O, awaited on rollpipe's
event loop. Mapping:

* action: ``{action_field: response}`` (OpenEnv actions are pydantic models; most text
  envs name their text field ``message``);
* observation: the observation's ``observation_field``; by default its only string field,
  else the whole observation as JSON;
* reward: the observation's ``reward`` (None counts as 0); done: its ``done``
  (``terminated``; OpenEnv has no separate truncation);
* ``info["action_valid"]`` / ``info["success"]``: the observation's boolean fields of
  those names, when the env declares them (OpenEnv does not send ``metadata`` to
  clients, so fields are the only way); ``info["observation"]``: the whole observation.

Each session is one env instance on the server: serve the app with
``create_app(..., max_concurrent_envs=N)``, N at least the pipeline's ``concurrency``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
from typing import Any

from rollpipe.envs.base import EnvStateError, Info, StepResult, check_seed

_CLOSE_WAIT_S = 5.0
_URL_SCHEMES = ("http://", "https://", "ws://", "wss://")


def _check_target(url: str | None, app: str | None) -> None:
    if (url is None) == (app is None):
        raise ValueError(
            f"OpenEnvEnv: give exactly one of url (a running server) or app (an app to "
            f"serve here, 'module:app'), got url={url!r}, app={app!r}"
        )
    if url is not None and not (isinstance(url, str) and url.startswith(_URL_SCHEMES)):
        raise ValueError(
            f"OpenEnvEnv: url={url!r} is not a server address; give 'http://host:port'"
        )
    if app is not None:
        module, _, attr = app.partition(":") if isinstance(app, str) else ("", "", "")
        found = False
        with contextlib.suppress(ImportError, ValueError):
            found = bool(module) and importlib.util.find_spec(module) is not None
        if not attr or not found:
            raise ValueError(
                f"OpenEnvEnv: app={app!r} must be 'module:app', the import path of an "
                "OpenEnv FastAPI app importable in this process (e.g. 'my_env.server.app:app')"
            )


class OpenEnvEnv:
    """A client of one OpenEnv env server, as an ``AsyncTextEnv``.

    ``url`` / ``app``: where the server is, or what to serve (exactly one).
    ``action_field``: the action's field that gets the response text. ``observation_field``:
    the observation's field shown to the model (None: its only string field, else JSON).
    ``startup_timeout_s``: limit for a served ``app`` to listen. ``message_timeout_s``: limit
    for one reply of the server.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        app: str | None = None,
        action_field: str = "message",
        observation_field: str | None = None,
        startup_timeout_s: float = 60.0,
        message_timeout_s: float = 60.0,
    ) -> None:
        _check_target(url, app)
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as exc:
            raise ImportError("OpenEnvEnv needs OpenEnv: pip install 'rollpipe[openenv]'") from exc
        self._client_class = GenericEnvClient
        self.url, self.app = url, app
        self.action_field, self.observation_field = action_field, observation_field
        self.startup_timeout_s, self.message_timeout_s = startup_timeout_s, message_timeout_s
        self._server: Any = None  # a LocalServer this adapter holds, for ``app``
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: bool | None = None  # None: before the first reset

    @property
    def where(self) -> str:
        """The server, for messages."""
        return f"url={self.url!r}" if self.app is None else f"app={self.app!r} at {self.url!r}"

    async def _connected(self) -> Any:
        """The session's client, connected on the running loop (a new loop reconnects)."""
        loop = asyncio.get_running_loop()
        if self._client is not None and self._loop is loop:
            return self._client
        self._drop_client()
        if self.app is not None and self._server is None:
            from rollpipe.envs.adapters.openenv_server import shared_server

            self._server = await asyncio.to_thread(shared_server, self.app, self.startup_timeout_s)
            self.url = self._server.url
        assert self.url is not None
        client = self._client_class(base_url=self.url, message_timeout_s=self.message_timeout_s)
        await client.connect()
        self._client, self._loop = client, loop
        return client

    async def _call(self, what: str, call: Any) -> Any:
        try:
            return await call
        except Exception as exc:
            said = ""
            if type(exc).__name__.startswith("ConnectionClosed"):  # websockets'
                said = await self._last_word()
                self._drop_client()  # the next reset opens a new session
            text = f"{type(exc).__name__}: {exc}{said}"
            hint = ""
            if "capacity" in text.lower():
                hint = (
                    "; the server holds fewer sessions than rollpipe runs episodes: serve the "
                    "app with create_app(..., max_concurrent_envs=N), N >= concurrency"
                )
            raise RuntimeError(
                f"OpenEnvEnv {what} on the server ({self.where}) failed: {text}{hint}"
            ) from exc

    async def _last_word(self) -> str:
        """What a server that closed the session sent before closing (e.g. why)."""
        ws = getattr(self._client, "_ws", None)  # OpenEnv's client keeps its socket here
        with contextlib.suppress(Exception):
            return f"; the server said: {await asyncio.wait_for(ws.recv(), 1.0)}"  # type: ignore[union-attr]
        return ""

    async def reset(self, seed: int) -> tuple[str, Info]:
        """Reset the server's env with ``seed``."""
        seed = check_seed(seed)
        client = await self._call("connect", self._connected())
        result = await self._call("reset", client.reset(seed=seed))
        self._done = bool(result.done)
        obs = dict(result.observation)
        info: Info = {"action_valid": True, "action": None, "observation": obs}
        info["success"] = bool(obs.get("success", False))
        return self._text(obs), info

    async def step(self, action_text: str) -> StepResult:
        """Send ``{action_field: action_text}``; reward and done are the server's."""
        if self._done is None or self._done:
            when = "before reset(seed)" if self._done is None else "after the episode ended"
            raise EnvStateError(f"OpenEnvEnv({self.where}).step() called {when}")
        client = await self._call("connect", self._connected())
        result = await self._call("step", client.step({self.action_field: action_text}))
        self._done = bool(result.done)
        obs = dict(result.observation)
        info: Info = {"action": action_text, "observation": obs}
        if isinstance(obs.get("action_valid"), bool):
            info["action_valid"] = obs["action_valid"]
        info["success"] = bool(obs.get("success", False))
        reward = 0.0 if result.reward is None else float(result.reward)
        return self._text(obs), reward, self._done, False, info

    def _text(self, obs: dict[str, Any]) -> str:
        """The observation as the model sees it."""
        if self.observation_field is not None:
            if self.observation_field not in obs:
                raise ValueError(
                    f"OpenEnvEnv: observation_field={self.observation_field!r} is not a field "
                    f"of the server's observation (fields: {sorted(obs)}); name one of those"
                )
            return str(obs[self.observation_field])
        texts = [v for k, v in obs.items() if isinstance(v, str)]
        if len(texts) == 1:
            return str(texts[0])
        shown = {k: v for k, v in obs.items() if k not in ("action_valid", "success")}
        return json.dumps(shown, sort_keys=True, default=str)

    def _drop_client(self) -> None:
        """Close the session's client on the loop it was opened on, as far as it can be."""
        client, loop = self._client, self._loop
        self._client = self._loop = None
        if client is None or loop is None:
            return
        with contextlib.suppress(Exception):
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                loop.create_task(client.close())
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(client.close(), loop).result(_CLOSE_WAIT_S)
            elif not loop.is_closed():
                loop.run_until_complete(client.close())
            # a closed loop: the socket closes with the client object

    def close(self) -> None:
        """End the session, and stop a served app if this was its last client."""
        self._drop_client()
        self._done = None
        server, self._server = self._server, None
        if server is not None:
            from rollpipe.envs.adapters.openenv_server import release

            release(server)
            self.url = None
