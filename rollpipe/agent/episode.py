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

Chat envs (``rollpipe.envs.base.ChatEnv``: the env declares ``tools``, answers with chat
messages, or sets ``step_input = "action"``) run through a
:class:`~rollpipe.agent.dialog.Dialog`: tools rendered by the chat template, the
response split by the model's own parsers (``tool_parser`` / ``reasoning_parser``) into
an ``AssistantAction`` (what ``step`` gets with ``step_input = "action"``; other envs
get the text as always), prompts extended token-exactly, prefix breaks recorded on the
turn. Text envs run exactly as before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from rollpipe._utils.checks import float_in, instance_of, int_in, one_of, optional, seconds_or_none
from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.chat import DEFAULT_SYSTEM_PROMPT, ChatFormat, parser_name
from rollpipe.agent.dialog import Dialog
from rollpipe.agent.engine_request import generate_turn
from rollpipe.agent.env_caller import Clock, EnvCaller
from rollpipe.agent.env_errors import EnvFailed
from rollpipe.agent.env_returns import check_reset, check_step, clip_reward
from rollpipe.agent.env_threads import EnvLease, EnvThreads
from rollpipe.agent.generation_timeout import GenerationTimeoutError
from rollpipe.agent.messages import messages_text
from rollpipe.agent.records import EndReason, EpisodeSpec, Trajectory, Turn
from rollpipe.agent.tools import tool_set
from rollpipe.engines.inputs import CheckedIds
from rollpipe.engines.protocol import Engine
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.engines.routing import Session, in_session
from rollpipe.envs.base import env_tools, takes_action
from rollpipe.envs.metrics import aggregate_metrics, step_metrics

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


# (id of the settings' sampling, end-of-turn id) -> (that sampling, the episode's): held,
# so an id is not reused while its entry lives; no hashing (a field may not hash)
_SAMPLINGS: dict[tuple[int, int | None], tuple[SamplingParams, SamplingParams]] = {}


def _episode_sampling(sampling: SamplingParams, eot_id: int | None) -> SamplingParams:
    """``sampling`` with the template's end-of-turn token among its stop ids (unless
    ``ignore_eos``): the same for every episode of a run, so made once per run (a
    ``replace`` checks every field again: ~5 µs an episode)."""
    key = (id(sampling), eot_id)
    hit = _SAMPLINGS.get(key)
    if hit is not None and hit[0] is sampling:
        return hit[1]
    stop_ids = tuple(sampling.stop_token_ids)
    if eot_id is not None and eot_id not in stop_ids and not sampling.ignore_eos:
        stop_ids = (*stop_ids, eot_id)
    out = sampling.replace(stop_token_ids=stop_ids)
    if len(_SAMPLINGS) >= 64:
        _SAMPLINGS.clear()
    _SAMPLINGS[key] = (sampling, out)
    return out


def _dialog(chat: ChatFormat, env: Any, observation: Any) -> Dialog | None:
    """A Dialog for a chat env (tools, message observations or structured actions), else
    None: text envs keep the text path exactly."""
    tools = env_tools(env)
    if not (tools or takes_action(env) or not isinstance(observation, str)):
        return None
    return Dialog(chat, tool_set(tools))


def _turn(prompt: Sequence[int], gen: Generation, text: str, observation: str) -> dict[str, Any]:
    n = len(gen.token_ids)
    return {
        "prompt_ids": prompt,
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
    """
    s = settings
    chat = chat.for_env(env)  # an env's own system prompt, if it declares one
    sampling, reward_clip, on_length = s.sampling, s.reward_clip, s.on_length
    penalty = s.cut_turn_reward
    clock = Clock()
    own_threads = env_threads is None  # run_episode alone: one thread, if the env blocks
    threads = EnvThreads(1, "rollpipe-episode-env") if env_threads is None else env_threads
    call_env = EnvCaller(
        env, spec, threads, s.env_timeout_s, env_lease, env_calls_on_threads, clock
    )

    def checked_step(result: Any) -> tuple[str, float, bool, bool, Any]:
        if reward_clip is not None:
            result, clipped = clip_reward(result, reward_clip)
            clock.clipped_rewards += clipped
        return check_step(env, result)

    session = Session(spec.episode_id)
    turns: list[Turn] = []
    # conversation mode: every id the engine has seen or produced, checked as it grew (the
    # engine's check costs the new ids); each turn's prompt is a view of it, not a copy
    context = CheckedIds()
    windowed = chat.history_window is not None
    sampling = _episode_sampling(sampling, chat.eot_id)  # each turn: max_tokens and seed
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
            final_observation=messages_text(observation),
            history_window=chat.history_window,
            env_metrics=aggregate_metrics(metrics, agg_modes),
            error_type=None if failure is None else type(failure.error).__name__,
            error_call=None if failure is None else failure.call,
        )

    with in_session(session):  # every request of the episode: a pool keeps it on one rank
        try:
            reset = functools.partial(check_reset, env)
            row = {} if spec.row_index is None else {"row": spec.row}  # a dataset's group
            observation, info = await call_env("reset", 0, reset, spec.seed, **row)
            success = bool(info.get("success", False))
            try:
                dialog = _dialog(chat, env, observation)
            except ValueError as exc:  # tools without a schema, a window with a chat env
                raise EnvFailed(exc, f"{type(env).__name__}.tools: {call_env.episode(0)}") from exc
            structured = dialog is not None and takes_action(env)
            for t in range(s.max_turns):
                broke, packed = False, None
                if dialog is None:  # the cached pieces come packed (None in window mode)
                    added, packed = chat.packed_turn_prompt(observation, turns)
                elif not turns:
                    added = dialog.first_prompt(observation)
                else:
                    added, broke = dialog.continuation(observation, turns[-1].response_ids)
                if not windowed:  # grown in place, bounds read from the row's own ids
                    packed = np.fromiter(added, np.int64, len(added)) if packed is None else packed
                    context.extend_packed(added, packed)
                prompt: Sequence[int] = added if windowed else context.view()  # not a copy
                budget = s.max_length - len(prompt)
                if budget < 1:
                    end_reason = "max_length"
                    break
                seed = derive_seed(spec.seed, spec.episode_id, t)
                params = sampling.for_request(min(sampling.max_tokens, budget), seed)
                try:
                    limit = s.generation_timeout_s
                    gen = await generate_turn(
                        engine, prompt, params, admit, s.max_aborts, clock, session, limit
                    )
                except GenerationTimeoutError as exc:
                    where = f"engine request: {call_env.episode(t)}"
                    raise EnvFailed(exc, f"{where}, generation_timeout_s={exc.limit}") from exc
                action = None if dialog is None else dialog.act(gen.token_ids, t)
                text = (
                    action.text if action is not None and structured else chat.decode(gen.token_ids)
                )
                fields = _turn(added, gen, text, messages_text(observation))
                fields["prefix_break"], fields["prompt_array"] = broke, packed
                if not windowed:  # past the end of the view the engine got (it may keep it)
                    context.extend_checked(gen.token_ids, trusted=True)
                if gen.finish_reason == "length" and on_length != "step":
                    turns.append(Turn(**fields, reward=penalty, action_valid=False, stepped=False))
                    if on_length == "end":
                        end_reason = "max_length"
                        break
                    continue
                try:
                    step = await call_env("step", t, checked_step, action if structured else text)
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
            if s.raise_env_errors:
                failed.reraise()
            end_reason, error, failure = "error", str(failed), failed
        finally:
            if own_threads:
                threads.close(0.0)  # its thread ends once idle (or once a hung call returns)
    return done(end_reason, error)
