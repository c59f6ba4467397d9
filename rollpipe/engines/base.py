"""The generation protocol shared by every engine: token ids in, token ids out.

``SamplingParams`` and ``Generation`` are the request and result records (defined in
``records.py``, re-exported here); ``Engine`` is the protocol the rollout stage talks
to. ``BaseEngine`` holds what the backends share: the engine-owned event-loop thread
that makes ``generate`` awaitable from any loop or thread, version bookkeeping,
``generate_batch`` and close/context-manager handling.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import torch

from rollpipe.engines.records import (
    FINISH_REASONS,
    EngineClosedError,
    EngineError,
    Generation,
    SamplingParams,
)
from rollpipe.runtime import Runtime

__all__ = [
    "FINISH_REASONS",
    "PAUSE_MODES",
    "BaseEngine",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "Generation",
    "PauseMode",
    "SamplingParams",
    "WeightsLike",
    "check_prompt",
    "named_tensors",
    "resolve_cpu_threads",
    "set_thread_torch_threads",
]

# vLLM's CPU worker replaces torch.set_num_threads with a no-op in its process; keep
# the real one so engines can set (and restore) it.
_TORCH_SET_NUM_THREADS = torch.set_num_threads


def resolve_cpu_threads(cpu_threads: int | None) -> int | None:
    """Torch threads for an engine's compute thread on CPU.

    ``None`` means 1 unless ``OMP_NUM_THREADS`` is set (then torch's own setting is
    kept): a tiny model gains nothing from intra-op parallelism, and OpenMP workers
    spin-waiting on a busy machine slow every step down many times over.
    """
    if cpu_threads is None:
        return None if "OMP_NUM_THREADS" in os.environ else 1
    if not isinstance(cpu_threads, int) or isinstance(cpu_threads, bool) or cpu_threads < 1:
        raise ValueError(f"cpu_threads must be None or an int >= 1, got {cpu_threads!r}")
    return cpu_threads


def set_thread_torch_threads(n: int | None) -> None:
    """Set torch's intra-op thread count for the calling thread only (OpenMP per-thread
    setting); ``None`` leaves it alone. Also undoes vLLM's no-op patch of the setter."""
    if torch.set_num_threads is not _TORCH_SET_NUM_THREADS:
        torch.set_num_threads = _TORCH_SET_NUM_THREADS
    if n is not None:
        _TORCH_SET_NUM_THREADS(n)


T = TypeVar("T")
PauseMode = Literal["keep", "abort", "wait"]
PAUSE_MODES: tuple[str, ...] = ("keep", "abort", "wait")
WeightsLike = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | torch.nn.Module


@runtime_checkable
class Engine(Protocol):
    """What the rollout stage needs from a generation backend."""

    @property
    def version(self) -> int: ...

    @property
    def is_paused(self) -> bool: ...

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation: ...

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]: ...

    def pause(self, mode: PauseMode = "keep") -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, weights: WeightsLike, version: int | None = None) -> int: ...

    def close(self) -> None: ...

    @property
    def runtime(self) -> Runtime:
        """The event loop the engine runs on; episodes run there too (no thread hop)."""
        ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc: object) -> None: ...


def named_tensors(weights: WeightsLike) -> list[tuple[str, torch.Tensor]]:
    """Normalise a state dict, an iterable of (name, tensor) or a module to a list."""
    if isinstance(weights, torch.nn.Module):
        items: Iterable[Any] = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    out: list[tuple[str, torch.Tensor]] = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                f"update_weights: expected (name, tensor) pairs, got {type(item).__name__}; "
                "pass a state dict, an iterable of (name, tensor) or a torch module"
            )
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"update_weights: weight {name!r} must be (str, Tensor), "
                f"got ({type(name).__name__}, {type(tensor).__name__})"
            )
        out.append((name, tensor.detach()))
    if not out:
        raise ValueError("update_weights: got no weights; pass a non-empty state dict")
    return out


def check_prompt(prompt_ids: Sequence[int], vocab_size: int | None = None) -> list[int]:
    """Validate prompt token ids; returns them as a list of Python ints."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.tolist()
    try:
        ids = list(map(int, prompt_ids))
    except (TypeError, ValueError) as e:
        raise ValueError(f"prompt_ids must be a sequence of ints, got {prompt_ids!r}") from e
    if not ids:
        raise ValueError("prompt_ids is empty; a prompt needs at least one token")
    if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        raise ValueError(
            f"prompt_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
        )
    return ids


class BaseEngine:
    """Shared machinery: the runtime, request bridging, versions, close.

    Subclasses implement ``_generate`` (a coroutine run on the engine's runtime),
    ``_pause``, ``_resume``, ``_load_weights`` and ``_shutdown`` (the latter four run on the
    runtime too), and the ``is_paused`` property.
    """

    def __init__(
        self, *, name: str, version: int = 0, loop_init: Callable[[], None] | None = None
    ) -> None:
        self._version = version
        self._closed = False
        self._dead: BaseException | None = None
        self._runtime = Runtime(name, loop_init)
        self._scope = self._runtime.scope(name)

    # -- state ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def runtime(self) -> Runtime:
        """The event loop this engine runs on. Coroutines running on it (a ``Rollout``'s
        episodes) reach the engine without a thread hop."""
        return self._runtime

    @property
    def is_paused(self) -> bool:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError(
                f"{type(self).__name__} is closed; create a new engine to generate again"
            )
        if self._dead is not None:
            raise EngineError(
                f"{type(self).__name__} died ({self._dead!r}); create a new engine"
            ) from self._dead

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the engine's runtime and block for its result (not from its loop)."""
        if self._runtime.in_loop():
            coro.close()
            raise EngineError(
                "this synchronous engine method was called from the engine's own event loop; "
                "call it from another thread"
            )
        try:
            self._check_open()
        except EngineError:
            coro.close()
            raise
        return self._scope.call(coro, timeout)

    # -- the protocol --------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Generate one completion; awaitable from any event loop or thread."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = check_prompt(prompt_ids, self._vocab_size())
        self._check_open()
        return await self._scope.run(self._generate(prompt, params))

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """Synchronous convenience: all ``prompts`` submitted at once, results in order."""
        if self._runtime.in_loop():
            raise EngineError("generate_batch blocks; do not call it on the engine's own loop")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        checked = [check_prompt(p, self._vocab_size()) for p in prompts]
        self._check_open()
        futures = [self._scope.submit(self._generate(p, params)) for p in checked]
        return [f.result() for f in futures]

    def pause(self, mode: PauseMode = "keep") -> None:
        """Stop generating: ``keep`` freezes in-flight requests, ``abort`` ends them with
        finish_reason "abort", ``wait`` lets them finish. New requests wait for resume."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._call(self._pause(mode))

    def resume(self) -> None:
        """Undo ``pause``: frozen and queued requests continue."""
        self._call(self._resume())

    def update_weights(self, weights: WeightsLike, version: int | None = None) -> int:
        """Load ``weights`` into the live engine; returns and stores the new version.

        ``version`` defaults to the current version + 1. Tokens produced after the call
        carry the new version.
        """
        if version is not None and (
            not isinstance(version, int) or isinstance(version, bool) or version < 0
        ):
            raise ValueError(
                f"update_weights: version must be None or an int >= 0, got {version!r}"
            )
        named = named_tensors(weights)
        new_version = self._version + 1 if version is None else version
        self._call(self._load_weights(named, new_version))
        return self._version

    def close(self) -> None:
        """Stop the engine; waiting and later ``generate`` calls raise EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        error = EngineClosedError(f"{type(self).__name__} was closed")
        self._scope.close(error)  # wakes every caller waiting on a request, at once
        try:
            if self._runtime.alive:
                self._runtime.call(self._shutdown(), timeout=60)
        except Exception:  # best effort: the runtime is closed below either way
            pass
        finally:
            self._runtime.close(error)
            self._after_close()

    def __enter__(self) -> BaseEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- backend hooks -------------------------------------------------------------------
    def _vocab_size(self) -> int | None:
        return None

    async def _generate(self, prompt: list[int], params: SamplingParams) -> Generation:
        raise NotImplementedError

    async def _pause(self, mode: PauseMode) -> None:
        raise NotImplementedError

    async def _resume(self) -> None:
        raise NotImplementedError

    async def _load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        """Stop the backend (runs on the engine loop during close)."""

    def _after_close(self) -> None:
        """Release what needs the caller's thread (after the loop stopped)."""
