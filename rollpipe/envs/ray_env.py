"""RayEnv: a text env hosted in a Ray actor, for envs that are heavy or need isolation.

The env is built inside a Ray actor (a process of its own, with the resources you
declare), and ``reset`` / ``step`` are awaited actor calls: to the rollout a ``RayEnv``
is an ``AsyncTextEnv`` like any other, and the env calls of many episodes overlap
instead of running one by one on the rollout's event loop. Worth it for envs whose
steps are slow or CPU-heavy, that leak or crash, or that need a process of their own (a
simulator, a browser); a fast pure-Python env such as FrozenLake is cheaper in-process
(``docs/ray-envs.md`` gives the measured overhead per call).

Outcomes, each defined (never a silent hang):

* **the actor dies** (its process crashed or was killed: ``RayActorError``): the call
  raises :class:`RayEnvError` naming the env and the actor, so only the current episode
  fails (it ends as ``"error"``; the pipeline drops its group and starts another). The
  next ``reset`` starts a fresh actor: the worker is replaced.
* **the env raises** in ``reset`` / ``step`` (``RayTaskError``): the env's own exception
  is raised, as it would be in-process; the actor stays.
* **a call hangs** (with ``call_timeout_s``): the actor is killed and :class:`RayEnvError`
  is raised; the next ``reset`` replaces it.
* **the actor does not start** within ``start_timeout_s`` (the cluster lacks the
  resources it asks for): :class:`RayEnvError` saying what it asked for and what is free.
* **the actor cannot start** (Ray workers cannot unpickle the env's factory: a class
  defined in a script or test module they cannot import): every ``reset`` raises
  :class:`RayEnvError` saying so, without starting actor after actor.
* ``close()`` closes the hosted env (waiting at most ``CLOSE_WAIT_S``) and kills the actor.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rollpipe._utils.ray_calls import ActorLost, ActorRaised, call_actor, ray_text
from rollpipe.agent.env_contract import runs_own_episode
from rollpipe.envs.base import Info, StepResult
from rollpipe.envs.registry import check_config, factory_of, make, register

if TYPE_CHECKING:
    from rollpipe.agent.env_contract import EnvForSpec
    from rollpipe.agent.records import EpisodeSpec

__all__ = [
    "CLOSE_WAIT_S",
    "DEFAULT_NUM_CPUS",
    "DEFAULT_START_TIMEOUT_S",
    "EnvHost",
    "RayEnv",
    "RayEnvError",
    "check_hostable",
    "ray_env_factory",
]

DEFAULT_NUM_CPUS = 0.25
"""CPUs an env actor reserves by default: a fraction, so many envs fit beside the engines."""
DEFAULT_START_TIMEOUT_S = 120.0
"""How long a new actor may take to be scheduled and start its process."""
CLOSE_WAIT_S = 2.0
"""How long ``RayEnv.close()`` waits for the hosted env's own ``close()`` before the kill."""


class RayEnvError(RuntimeError):
    """The actor hosting a :class:`RayEnv` died, hung, did not start or is gone."""


class EnvHost:
    """The actor's body: one env, built in the actor's process on the first ``reset``.

    Built lazily, so an env whose constructor raises fails ``reset`` with its own
    exception (and the next ``reset`` tries again) instead of killing the actor.
    """

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build = build
        self.env: Any = None

    def pid(self) -> int:
        """This process's id (the actor is up once it answers)."""
        return os.getpid()

    async def reset(self, seed: int, **row: Any) -> tuple[str, Info]:
        if self.env is None:
            self.env = self.build()
        result: tuple[str, Info] = await _result(self.env.reset(seed, **row))
        return result

    async def step(self, action_text: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("EnvHost.step() called before reset(seed)")
        result: StepResult = await _result(self.env.step(action_text))
        return result

    def close(self) -> None:
        close = getattr(self.env, "close", None)  # TextEnv.close is optional for user envs
        if close is not None:
            close()


async def _result(value: Any) -> Any:
    """``value``, awaited if the env's method was a coroutine (an ``AsyncTextEnv``)."""
    return await value if inspect.isawaitable(value) else value


def _build_registered(name: str, factory: Callable[..., Any], config: dict[str, Any]) -> Any:
    """In the actor: register the driver's factory (the actor's registry has only the
    built-in envs), then build through the registry as ``rollpipe.envs.make`` does."""
    register(name, factory, overwrite=True)
    return make(name, **config)


def _host_class() -> Any:
    import ray

    return ray.remote(EnvHost)


def _actor_options(num_cpus: float, actor_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Checked Ray actor options: ``num_cpus`` plus the passthrough ones."""
    if not _is_number(num_cpus) or num_cpus < 0:
        raise ValueError(f"RayEnv: num_cpus must be a finite number >= 0, got {num_cpus!r}")
    if actor_options is not None and not isinstance(actor_options, Mapping):
        raise ValueError(
            "RayEnv: actor_options must be a mapping of Ray actor options or None, "
            f"got {type(actor_options).__name__}"
        )
    extra = dict(actor_options or {})
    if "num_cpus" in extra:
        raise ValueError(
            f"RayEnv: num_cpus given twice (num_cpus={num_cpus!r}, "
            f"actor_options['num_cpus']={extra['num_cpus']!r}); pass it as num_cpus only"
        )
    options = {"num_cpus": num_cpus, **extra}
    _host_class().options(**options)  # Ray rejects unknown options here, naming them
    return options


def _is_number(value: object) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and math.isfinite(value)  # type: ignore[arg-type]


def _timeout(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not _is_number(value) or value <= 0:
        raise ValueError(f"RayEnv: {name} must be a number > 0 or None (no limit), got {value!r}")
    return float(value)


class RayEnv:
    """An ``AsyncTextEnv`` whose env lives in a Ray actor (see the module doc).

    Args:
        name: the registered env name (the registry of this process: envs registered
            here are shipped to the actor), or a label when ``factory`` is given.
        config: keyword config for the env (checked here against the factory's keys).
        factory: a picklable callable building the env in the actor as
            ``factory(**config)``; default: the registry's factory for ``name``.
        num_cpus: CPUs the actor reserves (a fraction lets many envs share a core).
        actor_options: other Ray actor options (``num_gpus``, ``memory``,
            ``runtime_env``, ``scheduling_strategy``...).
        call_timeout_s: a ``reset``/``step`` taking longer kills the actor and fails
            the episode (None: no limit).
        start_timeout_s: how long a new actor may take to start (None: no limit).

    Ray must be initialised (``ray.init(...)``), or Ray starts a local cluster itself.
    The actor is created at construction and awaited at the first ``reset``; ``pids``
    lists the process id of each actor that hosted the env, oldest first.
    """

    def __init__(
        self,
        name: str,
        config: Mapping[str, Any] | None = None,
        *,
        factory: Callable[..., Any] | None = None,
        num_cpus: float = DEFAULT_NUM_CPUS,
        actor_options: Mapping[str, Any] | None = None,
        call_timeout_s: float | None = None,
        start_timeout_s: float | None = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"RayEnv: name must be a non-empty str, got {name!r}")
        self.name = name
        self.config = dict(config or {})
        self.call_timeout_s = _timeout("call_timeout_s", call_timeout_s)
        self.start_timeout_s = _timeout("start_timeout_s", start_timeout_s)
        self._options = _actor_options(num_cpus, actor_options)
        if factory is None:
            check_config(name, self.config)  # unknown names and keys list the valid ones
            self._build = functools.partial(_build_registered, name, factory_of(name), self.config)
        elif callable(factory):
            self._build = functools.partial(factory, **self.config)
        else:
            raise ValueError(f"RayEnv: factory must be callable or None, got {factory!r}")
        self.pids: list[int] = []
        self.actors_started = 0
        self._actor: Any = None
        self._pid: int | None = None  # the current actor's process id, once it answered
        self._lost: str | None = None  # why the last actor is gone (None: it is not)
        self._unhostable: str | None = None  # why no actor can host this env (sticky)
        self._closed = False
        self._start()

    @property
    def actor(self) -> Any:
        """The Ray actor hosting the env now (None after a crash until the next reset)."""
        return self._actor

    # -- AsyncTextEnv ---------------------------------------------------------------------
    async def reset(self, seed: int, **row: Any) -> tuple[str, Info]:
        """Start an episode (``row=``: a dataset's row, passed on); an actor that died or
        hung is replaced by a fresh one first."""
        self._check_open()
        if self._unhostable is not None:
            raise RayEnvError(self._unhostable)
        if self._actor is None:
            self._start()
        if self._pid is None:  # a new actor: wait until it is up
            self._pid = await self._call("pid", timeout=self.start_timeout_s)
            self.pids.append(self._pid)
        result: tuple[str, Info] = await self._call(
            "reset", seed, **row, timeout=self.call_timeout_s
        )
        return result

    async def step(self, action_text: str) -> StepResult:
        """One step in the actor; raises :class:`RayEnvError` if its actor is gone."""
        self._check_open()
        if self._actor is None:
            raise RayEnvError(
                f"RayEnv {self.name!r}: step() after its actor was lost ({self._lost}); "
                "call reset(seed) to start a fresh actor"
            )
        result: StepResult = await self._call("step", action_text, timeout=self.call_timeout_s)
        return result

    def close(self) -> None:
        """Close the hosted env (waiting at most ``CLOSE_WAIT_S``) and kill the actor;
        idempotent. Blocks the calling thread that long at most."""
        if self._closed:
            return
        self._closed = True
        actor, self._actor = self._actor, None
        if actor is None:
            return
        import ray

        with contextlib.suppress(Exception):  # a dead actor or a cluster already shut down
            ray.wait([actor.close.remote()], timeout=CLOSE_WAIT_S)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

    # -- the actor ----------------------------------------------------------------------------
    def _start(self) -> None:
        self._actor = _host_class().options(**self._options).remote(self._build)
        self._pid = None
        self._lost = None
        self.actors_started += 1

    def _check_open(self) -> None:
        if self._closed:
            raise RayEnvError(f"RayEnv {self.name!r} is closed; build a new one")

    def _describe(self) -> str:
        actor_id = getattr(getattr(self._actor, "_actor_id", None), "hex", lambda: "?")()
        return f"Ray actor {actor_id} (pid {self._pid or 'not started'})"

    async def _call(self, method: str, *args: Any, timeout: float | None, **kwargs: Any) -> Any:
        """``actor.method(*args, **kwargs)``, awaited on the running loop."""
        try:
            return await call_actor(self._actor, method, *args, timeout=timeout, **kwargs)
        except ActorLost as e:
            if e.init_failed:  # EnvHost.__init__ only unpickles the factory
                self._unhostable = (
                    f"RayEnv {self.name!r}: no Ray actor can host this env, its actor failed "
                    f"to start: {ray_text(e.error)}. Usually Ray workers cannot unpickle the "
                    "env's factory: make it importable there (a module on their PYTHONPATH, "
                    "runtime_env={'py_modules': [...]}, or "
                    "ray.cloudpickle.register_pickle_by_value(module))"
                )
                self._lose(method, "failed to start")
                raise RayEnvError(self._unhostable) from e
            raise self._lose(method, "died", ray_text(e.error)) from e
        except ActorRaised as e:  # the env raised: its own exception, as in-process
            if isinstance(e.cause, Exception):
                raise e.cause from e
            raise RayEnvError(f"RayEnv {self.name!r}: the env's {method}() failed: {e}") from e
        except TimeoutError:  # after ActorRaised: an env's own TimeoutError is one too
            raise self._timed_out(method, timeout) from None

    def _timed_out(self, method: str, timeout: float | None) -> RayEnvError:
        if method != "pid":
            what = f"did not answer within call_timeout_s={timeout}s and was killed"
            return self._lose(method, what)
        import ray

        free: Any = "unknown"
        with contextlib.suppress(Exception):
            free = ray.available_resources()
        return self._lose(
            "start",
            f"did not start within start_timeout_s={timeout}s (it asks for {self._options}; "
            f"free in the cluster: {free}): lower num_cpus or the number of envs (the "
            "rollout's concurrency), or add nodes",
        )

    def _lose(self, method: str, what: str, ray_says: str = "") -> RayEnvError:
        """Forget the actor (killed, in case it only hangs) and say what happened."""
        actor, described = self._actor, self._describe()
        self._actor = None
        self._lost = f"{described} {what} during {method}()"
        if actor is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        return RayEnvError(
            f"RayEnv {self.name!r}: its {self._lost}; this episode fails, and the next "
            "reset() starts a fresh actor" + (f". Ray says: {ray_says}" if ray_says else "")
        )


_EPISODE_KINDS: dict[tuple[str, int], str | None] = {}  # (name, factory) -> own kind


def check_hostable(name: str, config: Mapping[str, Any]) -> None:
    """Raise ValueError if env ``name`` runs its own episode (an ``AgentEnv``: its agent
    calls the front door on the engine's event loop), which a Ray env worker, made to
    host ``reset`` / ``step``, cannot run. One env is built (then closed) per factory."""
    key = (name, id(factory_of(name)))
    if key not in _EPISODE_KINDS:
        env = make(name, **dict(config))
        try:
            own = runs_own_episode(env)
            _EPISODE_KINDS[key] = type(env).__name__ if own else None
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                close()
    kind = _EPISODE_KINDS[key]
    if kind is not None:
        raise ValueError(
            f"env {name!r} is an {kind}: it runs its own episode (an agent calling the "
            "front door on the engine's loop); env_backend='ray' hosts only text envs "
            "(reset / step) in Ray actors. Use env_backend='local' (an agent's calls are I/O "
            "on the loop: run its blocking work with asyncio.to_thread), or run the agent in "
            "a process of its own against a FrontDoor (docs/agents.md, 'The front door alone')"
        )


def _ray_env_for_spec(spec: EpisodeSpec, **options: Any) -> RayEnv:
    check_hostable(spec.env_name, spec.env_kwargs)  # before any actor starts
    return RayEnv(spec.env_name, spec.env_kwargs, **options)


def ray_env_factory(
    num_cpus: float = DEFAULT_NUM_CPUS,
    actor_options: Mapping[str, Any] | None = None,
    *,
    call_timeout_s: float | None = None,
    start_timeout_s: float | None = DEFAULT_START_TIMEOUT_S,
) -> EnvForSpec:
    """An env factory for ``EpisodeRunner(env_factory=...)``: a :class:`RayEnv` per env slot
    (the rollout keeps up to ``concurrency`` of them, so ``concurrency * num_cpus`` CPUs
    must fit in the cluster) hosting the registry's env for the spec. Options are
    checked here, not at the first episode."""
    _actor_options(num_cpus, actor_options)
    return functools.partial(
        _ray_env_for_spec,
        num_cpus=num_cpus,
        actor_options=None if actor_options is None else dict(actor_options),
        call_timeout_s=_timeout("call_timeout_s", call_timeout_s),
        start_timeout_s=_timeout("start_timeout_s", start_timeout_s),
    )
