"""Conversation: one conversation's state, and the one place a turn is built.

Two callers drive conversations: the env episode (``run_episode``: an env's
observations) and the front door's session (``AgentSession``: an agent's requests).
Both go through this object, so a turn's sampling rule, its engine request, its
:class:`~rollpipe.agent.records.Turn` and the episode's
:class:`~rollpipe.agent.records.Trajectory` are written once. A conversation owns:

* the ids so far (``context``: every id the engine saw or produced, checked as it grew;
  each turn's prompt is a view of it, not a copy) and the turns recorded;
* how the next prompt is rendered, in one of two implementations:
  :class:`TextConversation` (a text env: :class:`~rollpipe.agent.chat.ChatFormat`'s
  cached pieces, whole conversation or a window of the last turns) and
  :class:`ChatConversation` (messages, tools and the model's parsers: a
  :class:`~rollpipe.agent.dialog.Dialog` render diff, token-exact);
* the turn's sampling (:meth:`Conversation.turn_sampling`: the template's end-of-turn
  token among the stop ids, ``max_tokens`` within the budget left, a seed derived from
  the episode and the turn) and its engine request (:meth:`Conversation.generate`: held
  while the pipeline is suspended, kept on the episode's engine rank; see
  :func:`generate_turn`).

Examples:
    >>> from rollpipe import ChatFormat, EpisodeSpec, SamplingParams
    >>> from rollpipe.agent.conversation import TextConversation
    >>> conv = TextConversation(EpisodeSpec(0, 0, 7), ChatFormat(tokenizer),
    ...                         SamplingParams(max_tokens=8))
    >>> prompt, added, _, _ = conv.prompt("You stand at the start.")
    >>> list(prompt) == list(added)  # turn 0: the whole prompt is new
    True
    >>> conv.turn_sampling(budget=5).max_tokens  # min(max_tokens, the budget left)
    5
"""

from __future__ import annotations

import copy
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from rollpipe._utils.seeding import derive_seed
from rollpipe.agent.actions import AssistantAction
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.dialog import Dialog, Observation
from rollpipe.agent.env_caller import Clock
from rollpipe.agent.generation_timeout import answer_within
from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
from rollpipe.agent.tools import ToolSet
from rollpipe.engines.inputs import CheckedIds
from rollpipe.engines.protocol import Engine, OnTokens
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.engines.routing import Route, current_route, in_route

__all__ = [
    "OFF_LOOP_CHARS",
    "ChatConversation",
    "ChatPrompt",
    "Conversation",
    "TextConversation",
    "generate_turn",
]

Admit = Callable[[], Awaitable[None]] | None
OFF_LOOP_CHARS = 2048
"""A chat prompt that renders this many characters or more (about 0.2 ms of template and
tokenizer here, and growing with them) runs off the event loop, on the episode's env
thread: below it, the thread hop costs more than the render."""
TurnPrompt = tuple[Sequence[int], Sequence[int], "npt.NDArray[np.int64] | None", bool]
"""A turn's engine prompt, the ids it adds to the row, those packed (None in window
mode), and whether the template broke the prefix."""

# (id of the settings' sampling, end-of-turn id) -> (that sampling, the conversation's):
# held, so an id is not reused while its entry lives; no hashing (a field may not hash)
_SAMPLINGS: dict[tuple[int, int | None], tuple[SamplingParams, SamplingParams]] = {}


def stopping_at_end_of_turn(sampling: SamplingParams, eot_id: int | None) -> SamplingParams:
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


class Conversation:
    """One conversation's ids, turns, sampling, engine requests and records.

    ``spec`` names the episode (its seed and id derive each turn's sampling seed, its id
    routes the requests); ``chat`` renders; ``sampling`` is the run's sampling, each
    request's overrides applied on top; ``clock`` counts where the time went (shared with
    the episode's env calls); ``route`` is the routing key its requests are made in.
    """

    structured = False  # whether an env is stepped with the parsed action (chat envs)

    def __init__(
        self,
        spec: EpisodeSpec,
        chat: ChatFormat,
        sampling: SamplingParams,
        clock: Clock | None = None,
        route: Route | None = None,
    ) -> None:
        self.spec, self.chat = spec, chat
        self.base_sampling = sampling
        self.sampling = stopping_at_end_of_turn(sampling, chat.eot_id)
        self.clock = Clock() if clock is None else clock
        # an engine pool keeps the conversation's requests on one rank
        self.route = Route(spec.episode_id) if route is None else route
        self.turns: list[Turn] = []
        self.context = CheckedIds()  # the current row's ids so far
        self.windowed = chat.history_window is not None  # each prompt rendered afresh

    # -- a turn -----------------------------------------------------------------------
    def turn_sampling(
        self, budget: int, overrides: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        """The next turn's sampling: ``max_tokens`` within ``budget`` (tokens left before
        ``max_length``), the seed ``derive_seed(spec.seed, spec.episode_id, turn)``, the
        end-of-turn token among the stop ids; ``overrides`` (a request's own fields) win."""
        spec = self.spec
        seed = derive_seed(spec.seed, spec.episode_id, len(self.turns))
        if not overrides:
            return self.sampling.for_request(min(self.sampling.max_tokens, budget), seed)
        base, wanted = self.base_sampling, dict(overrides)
        max_tokens = min(wanted.pop("max_tokens", base.max_tokens), budget)
        seed = wanted.pop("seed", seed)
        stop, eot = tuple(base.stop_token_ids), self.chat.eot_id
        if eot is not None and eot not in stop and not wanted.get("ignore_eos", base.ignore_eos):
            stop = (*stop, eot)
        return base.replace(**wanted, max_tokens=max_tokens, seed=seed, stop_token_ids=stop)

    def generate(
        self,
        engine: Engine,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        admit: Admit = None,
        max_aborts: int,
        timeout_s: float | None = None,
        on_tokens: OnTokens = None,
    ) -> Awaitable[Generation]:
        """The turn's engine request (``generate_turn``): after ``admit()``, in the
        conversation's routing session, sent again while the engine aborts it."""
        return generate_turn(
            engine,
            prompt,
            params,
            admit,
            max_aborts,
            self.clock,
            self.route,
            timeout_s,
            on_tokens=on_tokens,
        )

    def record(
        self,
        added: Sequence[int],
        gen: Generation,
        action_text: str,
        observation: str,
        reward: float,
        action_valid: bool | None,
        stepped: bool = True,
        prefix_break: bool = False,
        prompt_array: npt.NDArray[np.int64] | None = None,
        new_row: bool = False,
        constrained: bool = False,
    ) -> Turn:
        """The turn of ``gen`` (its prompt part ``added``), kept; the rest are the
        :class:`Turn`'s fields. An engine asked for no logprobs returns none: each token
        records 0.0 (documented)."""
        ids = gen.token_ids
        n = len(ids)
        turn = Turn(
            prompt_ids=added,
            response_ids=ids,
            logprobs=gen.logprobs if len(gen.logprobs) == n else (0.0,) * n,
            versions=gen.versions,
            reward=reward,
            finish_reason="length" if gen.finish_reason == "length" else "stop",
            action_valid=action_valid,
            action_text=action_text,
            observation=observation,
            stepped=stepped,
            prefix_break=prefix_break,
            new_row=new_row,
            constrained=constrained,
            prompt_array=prompt_array,
        )
        self.turns.append(turn)
        return turn

    def trajectory(self, score: float | None = None, **fields: Any) -> Trajectory:
        """The conversation as a :class:`Trajectory`; ``score`` (the turns' rewards summed
        by default) and ``fields`` are its other fields (``end_reason``, ``env_id``...)."""
        clock = self.clock
        turns = self.turns
        return Trajectory(
            spec=self.spec,
            turns=tuple(turns),
            score=sum(t.reward for t in turns) if score is None else score,
            env_time_s=clock.env,
            engine_time_s=clock.engine,
            aborted_tokens=clock.aborted_tokens,
            clipped_rewards=clock.clipped_rewards,
            history_window=self.chat.history_window,
            **fields,
        )

    def prompt(self, observation: Any) -> TurnPrompt:
        """The next turn's prompt for an env's ``observation`` (see :data:`TurnPrompt`)."""
        raise NotImplementedError

    def renders_off_loop(self, observation: Any) -> bool:
        """Whether :meth:`prompt` for ``observation`` is big enough to run off the event
        loop (on the episode's env thread), so that rendering and tokenizing it costs only
        this episode: never for a text conversation (its pieces are cached per
        observation)."""
        return False

    def read(self, response_ids: Sequence[int]) -> tuple[str, AssistantAction | None]:
        """The response's text (what a text env is stepped with), and the action parsed
        from it (chat conversations only)."""
        return self.chat.decode(response_ids), None

    def responded(self, gen: Generation) -> None:
        """``gen``'s ids join the conversation (past the end of the view the engine got,
        which it may keep); a window's prompts are rendered afresh instead."""
        if not self.windowed:
            self.context.extend_checked(gen.token_ids, trusted=True)


class TextConversation(Conversation):
    """A text env's conversation: each prompt from :class:`ChatFormat`'s cached pieces
    (conversation mode: appended to the ids so far; window mode: a fresh step prompt)."""

    def prompt(self, observation: str) -> TurnPrompt:
        """The next turn's engine prompt, what it adds to the row, that packed, and
        whether the template broke the prefix (never, for text)."""
        added, packed = self.chat.packed_turn_prompt(observation, self.turns)
        if packed is None:  # window mode: a fresh step prompt, not appended
            return added, added, None, False
        self.context.extend_packed(added, packed)  # bounds read from the row's own ids
        return self.context.view(), added, packed, False


@attrs.frozen
class ChatPrompt:
    """One chat turn's engine prompt: all of ``ids``; ``added`` is what it appends to the
    row (the whole prompt when ``new_row``); ``new`` the messages it added; ``dialog`` the
    conversation with them added, adopted by :meth:`ChatConversation.adopt`; ``tools``
    the tool schemas rendered."""

    ids: CheckedIds
    added: list[int]
    new_row: bool
    new: tuple[dict[str, Any], ...]
    dialog: Dialog
    tools: tuple[dict[str, Any], ...] = ()


class ChatConversation(Conversation):
    """A conversation of messages with tools and the model's parsers, kept token-exact by
    a :class:`Dialog` render diff. An env episode proposes each turn from its env's
    messages; a front-door session from an agent's whole message list, which starts a new
    row (a fresh render) where it does not extend the conversation."""

    def __init__(
        self,
        spec: EpisodeSpec,
        chat: ChatFormat,
        sampling: SamplingParams,
        clock: Clock | None = None,
        route: Route | None = None,
        *,
        tools: ToolSet | None = None,
        system: bool = True,
        structured: bool = False,
    ) -> None:
        super().__init__(spec, chat, sampling, clock, route)
        self.structured = structured  # the env steps with the action, not the text
        self.dialog: Dialog | None = None if tools is None else self._dialog(tools, system)
        self.tools: tuple[dict[str, Any], ...] = ()  # the schemas the current row renders
        self.prefix_breaks = 0

    def _dialog(self, tools: ToolSet, system: bool) -> Dialog:
        dialog = Dialog(self.chat, tools)
        if not system:
            dialog.messages = []  # the agent's messages are the whole conversation
        return dialog

    # -- an env episode ---------------------------------------------------------------
    def prompt(self, observation: Observation) -> TurnPrompt:
        """The next turn's prompt for the env's ``observation`` (its first messages, or
        new ones after the last response), as :meth:`TextConversation.prompt` gives it."""
        dialog = self.dialog
        assert dialog is not None, "ChatConversation.prompt needs the episode's tools"
        added: Sequence[int]
        if not self.turns:
            added, broke = dialog.first_prompt(observation), False
            packed = np.fromiter(added, np.int64, len(added))
        else:
            response = self.turns[-1].response_ids
            (added, packed), broke = dialog.packed_continuation(observation, response)
        self.prefix_breaks += broke
        self.context.extend_packed(added, packed)
        return self.context.view(), added, packed, broke

    def renders_off_loop(self, observation: Observation) -> bool:
        """Whether the next prompt renders :data:`OFF_LOOP_CHARS` characters or more (the
        new messages and what the dialog's render of them shows again): a big tool
        result is rendered and tokenized on the episode's env thread, not on the loop
        that serves every episode."""
        dialog = self.dialog
        limit = OFF_LOOP_CHARS
        return dialog is not None and dialog.render_chars(observation, limit) >= limit

    def read(self, response_ids: Sequence[int]) -> tuple[str, AssistantAction]:
        """The response parsed by the model's parsers into an action, added to the
        conversation; its text (the action's, when the env steps with the action)."""
        assert self.dialog is not None
        action = self.dialog.act(response_ids, len(self.turns))
        return (action.text if self.structured else self.chat.decode(response_ids)), action

    # -- an agent's requests ----------------------------------------------------------
    def propose(
        self,
        messages: list[dict[str, Any]],
        tools: tuple[dict[str, Any], ...],
        tool_set: Callable[[], ToolSet],
    ) -> ChatPrompt:
        """The prompt of a request with ``messages`` and ``tools`` (``tool_set()``: those
        tools as a :class:`ToolSet`, asked for when the request starts a new row).
        Nothing changes until :meth:`adopt`: a request that fails leaves the conversation
        as it was."""
        dialog = self.dialog
        if (
            dialog is not None
            and self.turns
            and tools == self.tools
            and len(messages) > len(dialog.messages)
            and messages[: len(dialog.messages)] == dialog.messages
        ):
            new = messages[len(dialog.messages) :]
            trial = copy.copy(dialog)
            trial.messages = list(dialog.messages)
            added, broke = trial.continuation(new, self.turns[-1].response_ids)
            if not broke:
                return ChatPrompt(
                    self.context.extended(added), added, False, tuple(new), trial, tools
                )
        started = self._dialog(tool_set(), system=False)
        ids = started.first_prompt(messages)
        new_row = bool(self.turns)
        return ChatPrompt(CheckedIds(ids), ids, new_row, tuple(messages), started, tools)

    def adopt(self, prompt: ChatPrompt, gen: Generation) -> None:
        """Make ``prompt`` and its answer ``gen`` the conversation's (a new row when the
        prompt starts one)."""
        if prompt.new_row or self.dialog is None:
            self.tools = prompt.tools
            self.prefix_breaks += prompt.new_row
        self.dialog = prompt.dialog
        self.context = prompt.ids.extended(gen.token_ids)  # prompt.ids stays the prompt


async def generate_turn(
    engine: Engine,
    prompt: Sequence[int],
    params: SamplingParams,
    admit: Callable[[], Awaitable[None]] | None,
    max_aborts: int,
    clock: Clock,
    session: Route,
    limit: float | None = None,
    on_tokens: OnTokens = None,
) -> Generation:
    """One turn's engine request, sent again while the engine aborts it.

    An engine paused with ``mode="abort"`` ends its requests with ``finish_reason ==
    "abort"``; the turn then asks again (after ``admit()``, which holds it while the pipeline
    is paused), up to ``max_aborts`` times in a row. Each request is made in the episode's
    routing session (``rollpipe.engines.routing``), so an engine pool keeps the episode on
    the rank that holds its prefix.

    An episode's turn is generated again from its prompt. A streamed turn (``on_tokens``,
    the front door's ``stream=true``) cannot be: its first tokens are already with the
    client. It **continues** instead: the next request is the prompt plus the tokens
    produced so far, with the budget left, and the answer is the parts joined, each token
    with the version that produced it (what a ``keep`` pause gives too).


    ``admit()`` holds the re-sent request until the pipeline resumes; without a gate it
    goes straight back to the engine, which queues it until its own ``resume()``. The
    request is made in ``session`` (``run_episode`` enters it once for the whole episode;
    another caller's request enters it here). ``on_tokens`` gets the ids as produced.
    """
    aborts = 0
    parts: list[Generation] = []  # a streamed turn's aborted pieces
    while True:
        if admit is not None:
            await admit()
        start = time.perf_counter()
        if current_route() is session:  # the caller's task runs in it already
            gen = await _request(engine, prompt, params, limit, on_tokens)
        else:
            with in_route(session):  # an engine pool keeps the episode on one rank
                gen = await _request(engine, prompt, params, limit, on_tokens)
        clock.engine += time.perf_counter() - start
        if gen.finish_reason != "abort":
            return Generation.joined([*parts, gen], gen.finish_reason) if parts else gen
        if on_tokens is None:
            clock.aborted_tokens += len(gen.token_ids)
        elif gen.token_ids:  # continue from what is already out
            parts.append(gen)
            left = params.max_tokens - len(gen.token_ids)
            if left < 1:
                return Generation.joined(parts, "length")
            prompt, params = [*prompt, *gen.token_ids], params.replace(max_tokens=left)
        aborts += 1
        if aborts > max_aborts:
            raise EngineError(
                f"engine aborted the same request {aborts} times in a row; raise max_aborts "
                "or check why the engine keeps aborting (paused with mode='abort'?)"
            )


def _request(
    engine: Engine,
    prompt: Sequence[int],
    params: SamplingParams,
    limit: float | None,
    on_tokens: OnTokens,
) -> Awaitable[Generation]:
    """The engine request (``on_tokens`` passed only when set: engines written before it
    keep working), within ``limit`` if one is set."""
    if on_tokens is None:
        request = engine.generate(prompt, params)
    else:
        request = engine.generate(prompt, params, on_tokens=on_tokens)
    return request if limit is None else answer_within(engine, request, limit)
