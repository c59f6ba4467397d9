"""run_episode: one episode as a coroutine — reset, then (prompt -> engine -> step) turns.

Many episodes run concurrently on one event loop; their requests reach the engine
together and its continuous batching does the batching. A ``TextEnv``'s calls run on
``env_threads`` (:class:`~rollpipe.agent.env_threads.EnvThreads`), never on the loop,
unless the env declares ``blocking = False`` (the built-in grid envs: fast, pure Python),
which runs them inline; ``AsyncTextEnv`` methods are awaited directly. Every call is
limited to ``env_timeout_s`` seconds (None: no limit).

Outcomes, each defined (never a hang):

* env says terminated / truncated -> ``end_reason`` of the same name;
* ``max_turns`` turns taken -> ``"max_turns"``;
* the next prompt leaves no room to generate within ``max_length`` (also at turn 0,
  giving a trajectory with no turns) -> ``"max_length"``;
* the env raises, returns something malformed (see ``env_returns``), reports malformed
  ``info["metrics"]`` or a call outlives ``env_timeout_s``, or an engine request outlives
  ``generation_timeout_s`` (optional; time paused does not count) -> ``"error"``; the error
  text (``env_errors``) is the exception's repr, cut to 500 characters, then where: env
  class and call, env name, seed, episode and turn. With ``raise_env_errors=True`` the
  exception itself is re-raised instead (its type kept, so ``except EnvTimeoutError``
  still catches it), with a note saying where (``BaseException.add_note``: the traceback
  prints it); engine errors always propagate;
* a response cut at ``max_tokens`` (finish_reason ``"length"``): ``on_length="step"``
  (default, as ROLL) hands the cut text to the env like any other response, and the
  env's reward is all it gets; ``"skip"`` does not step the env — the turn gets
  ``length_penalty`` and the episode continues from the same observation; ``"end"``
  gives the turn ``length_penalty`` and ends the episode with ``"max_length"``;
* finish_reason ``"abort"`` (engine paused with ``mode="abort"``): the partial
  response is discarded and the same turn is regenerated once ``admit()`` lets it.

Each step's ``info["metrics"]`` is aggregated into ``Trajectory.env_metrics`` as ROLL's
env managers do (see :mod:`rollpipe.envs.metrics`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.env_errors import EnvFailed
from rollpipe.agent.env_returns import check_reset, check_step, clip_reward
from rollpipe.agent.env_threads import EnvLease, EnvThreads, EnvTimeoutError
from rollpipe.agent.generation_timeout import GenerationTimeoutError, answer_within
from rollpipe.agent.records import EndReason, EpisodeSpec, Trajectory, Turn
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.routing import Session, in_session
from rollpipe.envs.base import is_blocking
from rollpipe.envs.metrics import aggregate_metrics, step_metrics

T = TypeVar("T")
_log = logging.getLogger(__name__)

SLOW_INLINE_S = 0.05
"""An inline (``blocking = False``) env call longer than this is reported, once per class:
the grid envs take microseconds, and every episode waits while one runs."""
_SLOW_INLINE_REPORTED: set[type] = set()
OnLength = Literal["step", "skip", "end"]
ON_LENGTH: tuple[str, ...] = ("step", "skip", "end")
DEFAULT_LENGTH_PENALTY = -0.1
"""The reward of a cut turn under ``on_length="skip"`` / ``"end"`` (never under ``"step"``)."""


DEFAULT_ENV_TIMEOUT_S = 60.0
"""Default limit of one ``reset`` / ``step`` call (``PipelineConfig.env_timeout_s``)."""


class _Clock:
    def __init__(self) -> None:
        self.env = 0.0
        self.engine = 0.0
        self.aborted_tokens = 0  # generated, then aborted by a pause and regenerated
        self.clipped_rewards = 0  # step rewards clipped to ±reward_clip


class _EnvCaller:
    """How one episode calls its env: awaited (async env), inline (declared
    ``blocking = False``) or on ``threads`` (any other), each call limited to ``timeout``
    seconds and its return ``check``ed. Any failure becomes ``EnvFailed``."""

    def __init__(
        self,
        env: Any,
        spec: EpisodeSpec,
        threads: EnvThreads,
        timeout: float | None,
        lease: EnvLease | None,
        force_threads: bool,
        clock: _Clock,
    ) -> None:
        self.env, self.spec, self.threads, self.timeout = env, spec, threads, timeout
        self.lease, self.clock = lease, clock
        self.inline = not force_threads and not is_blocking(env)

    def episode(self, turn: int) -> str:
        spec = self.spec
        return f"env {spec.env!r}, seed {spec.seed}, episode {spec.episode_id}, turn {turn}"

    def where(self, name: str, turn: int) -> str:
        limit = f", env_timeout_s={self.timeout}" if self.timeout is not None else ""
        return f"{type(self.env).__name__}.{name}: {self.episode(turn)}{limit}"

    async def __call__(self, name: str, turn: int, check: Callable[[Any], T], arg: Any) -> T:
        fn = getattr(self.env, name)
        start = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(fn):
                result = await self._awaited(fn(arg))
            elif self.inline:  # declared fast: cheaper than a thread hop
                result = fn(arg)
                self._check_inline_time(time.perf_counter() - start)
            else:
                if self.lease is not None:
                    self.lease.call_started()
                on_return = None if self.lease is None else self.lease.call_returned
                result = await self.threads.call(fn, arg, timeout=self.timeout, on_return=on_return)
            return check(await self._awaited(result) if inspect.isawaitable(result) else result)
        except Exception as exc:  # the env's failure, whatever it is
            raise EnvFailed(exc, self.where(name, turn)) from exc
        finally:
            self.clock.env += time.perf_counter() - start

    async def _awaited(self, awaitable: Any) -> Any:
        if self.timeout is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, self.timeout)
        except TimeoutError:
            raise EnvTimeoutError(f"no return within {self.timeout} s") from None

    def _check_inline_time(self, elapsed: float) -> None:
        cls = type(self.env)
        if self.timeout is not None and elapsed > self.timeout:
            raise EnvTimeoutError(
                f"took {elapsed:.2f} s inline on the event loop (over {self.timeout} s), "
                f"stalling every episode: {cls.__qualname__} declares blocking = False; "
                "remove that declaration so its calls run on env threads"
            )
        if elapsed > SLOW_INLINE_S and cls not in _SLOW_INLINE_REPORTED:
            _SLOW_INLINE_REPORTED.add(cls)
            _log.warning(
                "%s.%s declares blocking = False but one call took %.3f s inline on the "
                "event loop, stalling every episode and the engine meanwhile; remove that "
                "declaration so its calls run on env threads (reported once per class)",
                cls.__module__,
                cls.__qualname__,
                elapsed,
            )


async def _generate(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    admit: Callable[[], Awaitable[None]] | None,
    max_aborts: int,
    clock: _Clock,
    session: Session,
    limit: float | None = None,
) -> Generation:
    """One engine request, re-sent when the engine aborts it (paused with ``abort``).

    ``admit()`` holds the re-sent request until the pipeline resumes; without a gate it
    goes straight back to the engine, which queues it until its own ``resume()``.
    """
    aborts = 0
    while True:
        if admit is not None:
            await admit()
        start = time.perf_counter()
        with in_session(session):  # an engine pool keeps the episode on one rank
            gen = await answer_within(engine, engine.generate(prompt, params), limit)
        clock.engine += time.perf_counter() - start
        if gen.finish_reason != "abort":
            return gen
        clock.aborted_tokens += len(gen.token_ids)
        aborts += 1
        if aborts > max_aborts:
            raise EngineError(
                f"engine aborted the same request {aborts} times in a row; raise max_aborts "
                "or check why the engine keeps aborting (paused with mode='abort'?)"
            )


def _turn(prompt_ids: list[int], gen: Generation, text: str, observation: str) -> dict[str, Any]:
    n = len(gen.token_ids)
    return {
        "prompt_ids": prompt_ids,
        "response_ids": gen.token_ids,
        # engines asked for no logprobs return none: record 0.0 (documented)
        "logprobs": gen.logprobs if len(gen.logprobs) == n else (0.0,) * n,
        "versions": gen.versions,
        "finish_reason": gen.finish_reason,
        "action_text": text,
        "observation": observation,
    }


async def run_episode(
    spec: EpisodeSpec,
    env: Any,
    engine: Engine,
    chat: ChatFormat,
    *,
    sampling: SamplingParams,
    max_turns: int,
    max_length: int,
    env_id: int = 0,
    admit: Callable[[], Awaitable[None]] | None = None,
    env_threads: EnvThreads | None = None,
    env_timeout_s: float | None = DEFAULT_ENV_TIMEOUT_S,
    env_lease: EnvLease | None = None,
    env_calls_on_threads: bool = False,
    generation_timeout_s: float | None = None,
    reward_clip: float | None = None,
    raise_env_errors: bool = False,
    on_length: OnLength = "step",
    length_penalty: float | None = None,
    max_aborts: int = 1000,
) -> Trajectory:
    """Run one episode of ``env`` (a TextEnv or AsyncTextEnv) with ``engine``; see module doc.

    ``env.reset(spec.seed)`` starts it (group members share the seed, hence the start
    state); turn ``t`` samples with seed ``derive_seed(spec.seed, spec.episode_id, t)``.
    ``max_length`` is the token budget: of the whole conversation, or of each step
    prompt + response in window mode; each turn's ``max_tokens`` is
    ``min(sampling.max_tokens, budget left)``; the template's end-of-turn token is added
    to ``stop_token_ids`` (unless ``ignore_eos``). ``admit()`` is awaited before every
    engine request. Engines that return no logprobs get 0.0 per token. The env is not
    closed (the caller owns it). ``length_penalty`` (default ``DEFAULT_LENGTH_PENALTY``)
    is the reward of a cut turn under ``on_length="skip"``/``"end"``; with ``"step"``
    giving one is an error, since the env alone rewards a cut response there.

    Env calls: see the module doc. Without ``env_threads`` a blocking env gets one
    thread of its own for this episode. ``env_lease`` (the rollout's) is told when a call
    on a thread starts and returns, so the env is reused only once no call of it runs;
    ``env_calls_on_threads`` sends even ``blocking = False`` envs to the threads.
    ``reward_clip``, ``generation_timeout_s``: see ``PipelineConfig``.
    """
    if reward_clip is not None and not (
        isinstance(reward_clip, (int, float)) and 0 < reward_clip < math.inf
    ):
        raise ValueError(f"reward_clip must be a number > 0 or None, got {reward_clip!r}")
    for name, limit in (
        ("env_timeout_s", env_timeout_s),
        ("generation_timeout_s", generation_timeout_s),
    ):
        if limit is not None and not (isinstance(limit, (int, float)) and 0 < limit < math.inf):
            raise ValueError(f"{name} must be a number of seconds > 0 or None, got {limit!r}")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 tokens, got {max_length}")
    if on_length not in ON_LENGTH:
        raise ValueError(f"on_length must be one of {ON_LENGTH}, got {on_length!r}")
    if on_length == "step" and length_penalty is not None:
        raise ValueError(
            f"length_penalty={length_penalty} has no effect with on_length='step' (the env "
            "rewards a cut response); use on_length='skip' or 'end', or drop length_penalty"
        )
    penalty = DEFAULT_LENGTH_PENALTY if length_penalty is None else float(length_penalty)
    if not math.isfinite(penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    clock = _Clock()
    own_threads = env_threads is None  # run_episode alone: one thread, if the env blocks
    threads = EnvThreads(1, "rollpipe-episode-env") if env_threads is None else env_threads
    call_env = _EnvCaller(env, spec, threads, env_timeout_s, env_lease, env_calls_on_threads, clock)

    def checked_step(result: Any) -> tuple[str, float, bool, bool, Any]:
        if reward_clip is not None:
            result, clipped = clip_reward(result, reward_clip)
            clock.clipped_rewards += clipped
        return check_step(env, result)

    session = Session(spec.episode_id)
    turns: list[Turn] = []
    context: list[int] = []  # conversation mode: every id the engine has seen or produced
    windowed = chat.history_window is not None
    stop_ids = tuple(sampling.stop_token_ids)
    if chat.eot_id is not None and chat.eot_id not in stop_ids and not sampling.ignore_eos:
        stop_ids = (*stop_ids, chat.eot_id)
    end_reason: EndReason = "max_turns"
    error: str | None = None
    failure: EnvFailed | None = None
    success = False
    observation = ""
    metrics: list[dict[str, float]] = []  # each env step's info["metrics"]
    agg_modes: dict[str, str] = {}  # the latest aggregation mode named for each metric

    def done(reason: EndReason, err: str | None = None) -> Trajectory:
        return Trajectory(
            spec=spec,
            env_id=env_id,
            turns=tuple(turns),
            score=sum(t.reward for t in turns),
            success=success,
            end_reason=reason,
            error=err,
            env_time_s=clock.env,
            engine_time_s=clock.engine,
            aborted_tokens=clock.aborted_tokens,
            clipped_rewards=clock.clipped_rewards,
            final_observation=observation,
            history_window=chat.history_window,
            env_metrics=aggregate_metrics(metrics, agg_modes),
            error_type=None if failure is None else type(failure.error).__name__,
            error_call=None if failure is None else failure.call,
        )

    try:
        reset = functools.partial(check_reset, env)
        observation, info = await call_env("reset", 0, reset, spec.seed)
        success = bool(info.get("success", False))
        for t in range(max_turns):
            added = chat.turn_prompt(observation, turns)
            prompt = added if windowed else [*context, *added]
            budget = max_length - len(prompt)
            if budget < 1:
                end_reason = "max_length"
                break
            params = sampling.replace(
                max_tokens=min(sampling.max_tokens, budget),
                seed=derive_seed(spec.seed, spec.episode_id, t),
                stop_token_ids=stop_ids,
            )
            try:
                gen = await _generate(
                    engine, prompt, params, admit, max_aborts, clock, session, generation_timeout_s
                )
            except GenerationTimeoutError as exc:
                where = f"engine request: {call_env.episode(t)}"
                raise EnvFailed(exc, f"{where}, generation_timeout_s={exc.limit}") from exc
            fields = _turn(added, gen, chat.decode(gen.token_ids), observation)
            if not windowed:
                context = [*prompt, *gen.token_ids]
            if gen.finish_reason == "length" and on_length != "step":
                turns.append(Turn(**fields, reward=penalty, action_valid=False, stepped=False))
                if on_length == "end":
                    end_reason = "max_length"
                    break
                continue
            try:
                step = await call_env("step", t, checked_step, fields["action_text"])
            except EnvFailed:
                turns.append(Turn(**fields, reward=0.0, action_valid=False, stepped=False))
                raise
            observation, reward, terminated, truncated, info = step
            # an env that does not report action_valid: unknown (None), not invalid
            turns.append(Turn(**fields, reward=reward, action_valid=info.get("action_valid")))
            success = bool(info.get("success", False))
            try:
                step_values, modes = step_metrics(info)
            except ValueError as exc:  # the env's bug: recorded like an env error
                raise EnvFailed(exc, call_env.where("step", t)) from exc
            metrics.append(step_values)
            agg_modes.update(modes)
            if terminated or truncated:
                end_reason = "terminated" if terminated else "truncated"
                break
    except EnvFailed as failed:
        if raise_env_errors:
            failed.reraise()
        end_reason, error, failure = "error", str(failed), failed
    finally:
        if own_threads:
            threads.close(0.0)  # its thread ends once idle (or once a hung call returns)
    return done(end_reason, error)
