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
env managers do (see :mod:`rollpipe.agent.env_contract`).

Chat envs (``rollpipe.envs.base.ChatEnv``: the env declares ``tools``, answers with chat
messages, or sets ``step_input = "action"``) run through a
:class:`~rollpipe.agent.dialog.Dialog`: tools rendered by the chat template, the
response split by the model's own parsers (``tool_parser`` / ``reasoning_parser``) into
an ``AssistantAction`` (what ``step`` gets with ``step_input = "action"``; other envs
get the text as always), prompts extended token-exactly, prefix breaks recorded on the
turn. An env that declares a ``tool_runner`` (``ToolEnv``) has its tool calls run here,
by the episode, before its ``step`` gets the action with their results
(``action.tool_results``). A prompt that renders a big tool result (or any big message;
``OFF_LOOP_CHARS``) is rendered and tokenized on the episode's env thread, so it costs
only its own episode. Text envs run exactly as before.

A chat env runs the image conversation when its first observation holds an image, or
on an engine that supports images (so images may come later: a tool's picture, a later
observation); :mod:`rollpipe.agent.conversation_choice` decides and holds the hook the
image conversation registers with (agent/ never imports vision/). ``max_length`` counts
its prompts with images expanded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import attrs

from rollpipe._utils.checks import float_in, instance_of, int_in, one_of, optional, seconds_or_none
from rollpipe.agent.chat import DEFAULT_SYSTEM_PROMPT, ChatFormat, parser_name
from rollpipe.agent.conversation import Conversation, TextConversation
from rollpipe.agent.conversation_choice import episode_conversation
from rollpipe.agent.env_caller import Clock, EnvCaller
from rollpipe.agent.env_contract import (
    aggregate_metrics,
    is_blocking,
    is_chat_env,
    step_metrics,
    tool_runner,
)
from rollpipe.agent.env_errors import EnvFailed
from rollpipe.agent.env_returns import check_reset, check_step, clip_reward, messages_text
from rollpipe.agent.env_threads import EnvLease, EnvThreads
from rollpipe.agent.generation_timeout import GenerationTimeoutError
from rollpipe.agent.records import EndReason, EpisodeSpec, Trajectory
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import SamplingParams
from rollpipe.engines.routing import Route, in_route

OnLength = Literal["step", "skip", "end"]
ON_LENGTH: tuple[str, ...] = ("step", "skip", "end")
DEFAULT_LENGTH_PENALTY = -0.1
"""The reward of a cut turn under ``on_length="skip"`` / ``"end"`` (never under ``"step"``)."""


DEFAULT_ENV_TIMEOUT_S = 60.0
"""Default limit of one ``reset`` / ``step`` call (``EpisodeSettings.env_timeout_s``)."""
MAX_TURNS = 65536
MAX_LENGTH = 2**24
MAX_WINDOW = 65536
MAX_ABORTS = 10**6


def _sampling(value: SamplingParams | Mapping[str, Any]) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"EpisodeSettings.sampling must be a SamplingParams or a dict of its fields "
            f"(e.g. {{'max_tokens': 48}}), got {value!r}"
        )
    valid = sorted(f.name for f in attrs.fields(SamplingParams))
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ValueError(f"EpisodeSettings.sampling: unknown keys {unknown}; valid keys: {valid}")
    try:
        return SamplingParams(**value)
    except ValueError as exc:
        raise ValueError(f"EpisodeSettings.sampling: {exc}") from exc


_STR_OR_NONE: Any = optional(instance_of(str))


@attrs.frozen(kw_only=True)
class EpisodeSettings:
    """How one episode runs (``PipelineConfig.episode``), checked here once.

    ``max_turns``: turns before the episode ends with ``"max_turns"``. ``max_length``:
    token budget of a trajectory (prompts plus responses; of each step prompt plus
    response in window mode). ``sampling``: a ``SamplingParams`` or a dict of its fields.
    ``system_prompt`` / ``history_window``: the chat format (:meth:`chat_format`; a
    window ``k`` gives step prompts with the last ``k`` turns). ``env_timeout_s``: limit
    of one env ``reset`` / ``step`` call (None: no limit). ``generation_timeout_s``: limit
    of one engine request, time paused not counted (None: no limit). ``reward_clip``:
    clip step rewards to ``±c`` (None: a reward not finite in float32 fails the
    episode). ``raise_env_errors``: re-raise env exceptions instead of recording errored
    trajectories. ``on_length`` / ``length_penalty``: what a response cut at
    ``max_tokens`` does (see the module doc). ``max_aborts``: times one request may be
    aborted by pauses in a row before the episode gives up. ``tool_parser`` /
    ``reasoning_parser``: the model's vLLM parsers for chat envs (``"hermes"``,
    ``"qwen3"``, ...; see :mod:`rollpipe.agent.parsers`).

    Examples:
        >>> settings = EpisodeSettings(max_turns=3, sampling={"max_tokens": 16}, on_length="end")
        >>> settings.sampling.max_tokens, settings.cut_turn_reward
        (16, -0.1)
        >>> EpisodeSettings(length_penalty=-1.0)  # on_length="step" takes no penalty
        Traceback (most recent call last):
        ValueError: EpisodeSettings.length_penalty=-1.0 applies only to on_length='skip' or ...
    """

    max_turns: int = attrs.field(default=5, validator=int_in(1, MAX_TURNS))
    max_length: int = attrs.field(default=1024, validator=int_in(2, MAX_LENGTH))
    sampling: SamplingParams = attrs.field(
        factory=lambda: SamplingParams(max_tokens=48), converter=_sampling
    )
    system_prompt: str | None = attrs.field(default=DEFAULT_SYSTEM_PROMPT, validator=_STR_OR_NONE)
    history_window: int | None = attrs.field(
        default=None, validator=optional(int_in(0, MAX_WINDOW))
    )
    env_timeout_s: float | None = attrs.field(
        default=DEFAULT_ENV_TIMEOUT_S, validator=seconds_or_none()
    )
    generation_timeout_s: float | None = attrs.field(default=None, validator=seconds_or_none())
    reward_clip: float | None = attrs.field(
        default=None, validator=optional(float_in(0.0, low_open=True))
    )
    raise_env_errors: bool = attrs.field(default=False, validator=instance_of(bool))
    on_length: OnLength = attrs.field(default="step", validator=one_of(*ON_LENGTH))
    length_penalty: float | None = attrs.field(
        default=None, validator=optional(float_in(-math.inf))
    )
    max_aborts: int = attrs.field(default=1000, validator=int_in(0, MAX_ABORTS))
    tool_parser: str | None = attrs.field(default=None, validator=parser_name)
    reasoning_parser: str | None = attrs.field(default=None, validator=parser_name)

    def __attrs_post_init__(self) -> None:
        if self.on_length == "step" and self.length_penalty is not None:
            raise ValueError(
                f"EpisodeSettings.length_penalty={self.length_penalty} applies only to "
                "on_length='skip' or 'end'; with 'step' the env alone rewards a cut response"
            )

    @property
    def cut_turn_reward(self) -> float:
        """The reward of a cut turn under ``on_length="skip"`` / ``"end"``."""
        return DEFAULT_LENGTH_PENALTY if self.length_penalty is None else self.length_penalty

    def chat_format(self, tokenizer: Any) -> ChatFormat:
        """The :class:`ChatFormat` these settings describe, for ``tokenizer``."""
        return ChatFormat(
            tokenizer,
            system_prompt=self.system_prompt,
            history_window=self.history_window,
            tool_parser=self.tool_parser,
            reasoning_parser=self.reasoning_parser,
        )


async def run_episode(
    spec: EpisodeSpec,
    env: Any,
    engine: Engine,
    chat: ChatFormat,
    settings: EpisodeSettings,
    *,
    admit: Callable[[], Awaitable[None]] | None = None,
    env_threads: EnvThreads | None = None,
    env_lease: EnvLease | None = None,
    env_calls_on_threads: bool = False,
    env_id: int = 0,
) -> Trajectory:
    """Run one episode of ``env`` (a TextEnv or AsyncTextEnv) with ``engine``; see module doc.

    ``settings`` (an :class:`EpisodeSettings`, checked when it was built) say how:
    turns, token budget, sampling, timeouts, reward and length handling. The keywords
    are runtime wiring only. ``chat`` formats the prompts (its
    ``system_prompt`` and ``history_window`` are used, not those of ``settings``: build
    it with ``settings.chat_format(tokenizer)``; an env that declares ``system_prompt``
    gets its own).

    ``env.reset(spec.seed)`` starts it (group members share the seed, hence the start
    state); turn ``t`` samples with seed ``derive_seed(spec.seed, spec.episode_id, t)``.
    ``max_length`` is the token budget: of the whole conversation, or of each step
    prompt + response in window mode; each turn's ``max_tokens`` is
    ``min(sampling.max_tokens, budget left)``; the template's end-of-turn token is added
    to ``stop_token_ids`` (unless ``ignore_eos``). ``admit()`` is awaited before every
    engine request. Engines that return no logprobs get 0.0 per token. The env is not
    closed (the caller owns it).

    Env calls: see the module doc. Without ``env_threads`` a blocking env gets one
    thread of its own for this episode. ``env_lease`` (the rollout's) is told when a call
    on a thread starts and returns, so the env is reused only once no call of it runs;
    ``env_calls_on_threads`` sends even ``blocking = False`` envs to the threads.
    ``env_id`` is the env instance's id, reported in the rows.

    Examples:
        One FrozenLake episode, run on the engine's own event loop:

        >>> from rollpipe.envs import FrozenLake
        >>> settings = EpisodeSettings(max_turns=2, sampling={"max_tokens": 16})
        >>> spec, chat = EpisodeSpec(group_id=0, episode_id=0, seed=123), ChatFormat(tokenizer)
        >>> traj = engine.runtime.call(run_episode(spec, FrozenLake(), engine, chat, settings))
        >>> traj.end_reason in ("terminated", "max_turns"), 1 <= traj.num_turns <= 2
        (True, True)
        >>> all(len(t.response_ids) <= 16 and t.stepped for t in traj.turns)
        True
    """
    s = settings
    chat = chat.for_env(env)  # an env's own system prompt, if it declares one
    reward_clip, on_length, penalty = s.reward_clip, s.on_length, s.cut_turn_reward
    clock = Clock()
    # run_episode alone: one thread of its own, only if the env's calls go to threads
    own_threads = env_threads is None and (env_calls_on_threads or is_blocking(env))
    threads = EnvThreads(1, "rollpipe-episode-env") if own_threads else env_threads
    call_env = EnvCaller(
        env, spec, threads, s.env_timeout_s, env_lease, env_calls_on_threads, clock
    )

    def checked_step(result: Any) -> tuple[str, float, bool, bool, Any]:
        if reward_clip is not None:
            result, clipped = clip_reward(result, reward_clip)
            clock.clipped_rewards += clipped
        return check_step(env, result)

    route = Route(spec.episode_id)
    conv: Conversation = TextConversation(spec, chat, s.sampling, clock, route)
    end_reason: EndReason = "max_turns"
    error: str | None = None
    failure: EnvFailed | None = None
    success = False
    observation = ""
    metrics: list[dict[str, float]] = []  # each env step's info["metrics"]
    agg_modes: dict[str, str] = {}  # the latest aggregation mode named for each metric

    with in_route(route):  # every request of the episode: a pool keeps it on one rank
        try:
            reset = functools.partial(check_reset, env)
            row = {} if spec.row_index is None else {"row": spec.row}  # a dataset's group
            observation, info = await call_env("reset", 0, reset, spec.seed, **row)
            success = bool(info.get("success", False))
            try:
                if is_chat_env(env, observation):  # a text env keeps the text conversation
                    talk = episode_conversation(
                        spec, chat, env, observation, s.sampling, clock, route, engine
                    )
                    conv = conv if talk is None else talk
                runner = tool_runner(env) if conv.structured else None  # the episode runs them
                seen: Callable[[], int] | None = getattr(conv, "seen_length", None)  # images
            except ValueError as exc:  # tools without a schema, a window with a chat env
                raise EnvFailed(exc, f"{type(env).__name__}.tools: {call_env.episode(0)}") from exc
            for t in range(s.max_turns):
                if conv.renders_off_loop(observation):  # a big tool result: costs only us
                    prompt, added, packed, broke = await call_env.off_loop(conv.prompt, observation)
                else:
                    prompt, added, packed, broke = conv.prompt(observation)
                budget = s.max_length - (len(prompt) if seen is None else seen())
                if budget < 1:
                    end_reason = "max_length"
                    break
                params = conv.turn_sampling(budget)
                try:
                    gen = await conv.generate(
                        engine,
                        prompt,
                        params,
                        admit=admit,
                        max_aborts=s.max_aborts,
                        timeout_s=s.generation_timeout_s,
                    )
                except GenerationTimeoutError as exc:
                    where = f"engine request: {call_env.episode(t)}"
                    raise EnvFailed(exc, f"{where}, generation_timeout_s={exc.limit}") from exc
                text, action = conv.read(gen.token_ids)
                shown = messages_text(observation)
                # record(added, gen, action_text, observation, reward, action_valid, stepped,
                # prefix_break, prompt_array): positional, as every turn calls it
                conv.responded(gen)
                if gen.finish_reason == "length" and on_length != "step":
                    conv.record(added, gen, text, shown, penalty, False, False, broke, packed)
                    if on_length == "end":
                        end_reason = "max_length"
                        break
                    continue
                try:
                    stepped_with = action if conv.structured else text
                    if runner is not None and action is not None and action.calls_tools:
                        stepped_with = await call_env.run_tools(runner, action, t)
                    step = await call_env("step", t, checked_step, stepped_with)
                except EnvFailed:
                    conv.record(added, gen, text, shown, 0.0, False, False, broke, packed)
                    raise
                observation, reward, terminated, truncated, info = step
                # an env that does not report action_valid: unknown (None), not invalid
                valid = info.get("action_valid")
                conv.record(added, gen, text, shown, reward, valid, True, broke, packed)
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
            if s.raise_env_errors:
                failed.reraise()
            end_reason, error, failure = "error", str(failed), failed
        finally:
            if own_threads and threads is not None:
                threads.close(0.0)  # its thread ends once idle (or once a hung call returns)
    return conv.trajectory(
        env_id=env_id,
        success=success,
        end_reason=end_reason,
        error=error,
        final_observation=messages_text(observation),
        env_metrics=aggregate_metrics(metrics, agg_modes),
        error_type=None if failure is None else type(failure.error).__name__,
        error_call=None if failure is None else failure.call,
    )
