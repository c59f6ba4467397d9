"""AgentSession: one agent's calls, recorded as exact token ids, row by row.

Each request's messages are matched against the session's conversation (what earlier
requests sent plus the assistant messages the server answered, normalised). If they
extend it with the same tools, only the new messages are rendered and appended to the
row's ids (a :class:`~rollpipe.agent.dialog.Dialog` render diff): the model's own tokens
are kept, never re-tokenized. Otherwise (the agent edited its history, changed its
tools, or the template re-rendered earlier turns) a new row of the same trajectory
starts from a fresh render of the request, and ``prefix_breaks`` counts it.

``keep_tools`` (default True): a request without ``tools`` is rendered with the tools
the session was last sent, so the common agent whose final "answer" call leaves
``tools`` out continues its row instead of starting a second one. The engine sees that
render, so the row is still exactly the engine's tokens; only tools that differ (another
set, or tools where there were none) start a new row.

``trajectory()`` turns the rows into a :class:`~rollpipe.agent.records.Trajectory`, a
conversation-mode one as any chat env gives; the first turn of each later row is marked
``Turn.new_row`` (its ``prompt_ids`` are its whole prompt), so ``trajectory_rows`` gives
one row per session row and ``step_rows`` exactly each request's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import attrs

from rollpipe.agent.actions import AssistantAction
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.conversation import ChatConversation, ChatPrompt
from rollpipe.agent.conversation_choice import image_conversation
from rollpipe.agent.env_returns import messages_text
from rollpipe.agent.episode import EpisodeSettings
from rollpipe.agent.records import EndReason, EpisodeSpec, Trajectory, Turn
from rollpipe.agent.tools import ToolSet, tool_set
from rollpipe.engines.images import ImageTokenError
from rollpipe.engines.protocol import Engine, OnTokens
from rollpipe.engines.records import EngineError, Generation, SamplingParams
from rollpipe.frontdoor.forced import forced_action
from rollpipe.frontdoor.images import image_parts
from rollpipe.frontdoor.requests import ChatRequest, RequestError, normalise_message
from rollpipe.frontdoor.stops import cut_at_stop

__all__ = ["AgentSession", "Call", "Prompt"]


Prompt = ChatPrompt  # one request's engine prompt (the name the front door used)


@attrs.frozen
class Call:
    """One request, prepared by its session (:meth:`AgentSession.prepare`) and ready for
    the engine: the request, its engine prompt, its sampling, and whether a forced call
    comes as JSON (``forced.py``)."""

    request: ChatRequest
    prompt: Prompt
    params: SamplingParams
    json_calls: bool = False

    @property
    def constrained(self) -> bool:
        """Sampled under a grammar (a forced call's ``structured_outputs``)."""
        return self.params.structured_outputs is not None


class AgentSession:
    """The recorded calls of one episode's key (see the module doc), kept by a
    :class:`~rollpipe.agent.conversation.ChatConversation`: the same turn building as
    an env episode's.

    A call goes :meth:`answering` (one at a time), :meth:`prepare` (its :class:`Call`),
    :meth:`generate` and :meth:`record`; the front door's answers (``answers.py``,
    ``streaming.py``) drive the last two. ``admit`` (the pipeline's admission, awaited
    before each engine request) holds requests while the pipeline is suspended.
    ``keep_tools``: render a request without ``tools`` with the session's last tools.
    ``sampling``: the door's sampling, under each request's own fields. ``images``: the
    conversation is the registered image conversation (the door's engine supports
    images: ``rollpipe.vision.conversation``), so requests may hold images from any call
    on; its rows carry the expanded ids and each turn's image features, as an env
    episode's do.
    """

    def __init__(
        self,
        key: str,
        spec: EpisodeSpec,
        chat: ChatFormat,
        admit: Callable[[], Awaitable[None]] | None = None,
        *,
        keep_tools: bool = True,
        sampling: SamplingParams | None = None,
        images: bool = False,
    ) -> None:
        self.key, self.spec, self.chat, self.admit = key, spec, chat, admit
        self.keep_tools, self.images = keep_tools, images
        kind = image_conversation if images else ChatConversation
        self.conversation = kind(spec, chat, sampling or SamplingParams(), tools=None)
        self.tool_calls = 0  # calls the model made (``tool/calls``), and malformed ones
        self.malformed = 0
        self.lock = asyncio.Lock()
        self.finished = False
        self.failure: BaseException | None = None  # an engine error or request timeout
        self.in_flight: set[asyncio.Task[Any]] = set()
        self.last_request: ChatRequest | None = None  # its messages are not checked twice

    @property
    def calls(self) -> int:
        """The calls recorded so far."""
        return len(self.conversation.turns)

    @property
    def prefix_breaks(self) -> int:
        """The calls that started a new row (the agent did not extend its conversation)."""
        return self.conversation.prefix_breaks

    @property
    def rows(self) -> list[list[Turn]]:
        """The recorded turns, one list per row."""
        rows: list[list[Turn]] = []
        for turn in self.conversation.turns:
            if turn.new_row or not rows:
                rows.append([])
            rows[-1].append(turn)
        return rows

    @contextlib.asynccontextmanager
    async def answering(self) -> AsyncIterator[None]:
        """Around one call: calls of the session run one at a time, each in
        ``in_flight`` (cancelled when the session ends); ``RequestError`` (401) when the
        session ended while the call waited for its turn."""
        task = asyncio.current_task()
        assert task is not None
        self.in_flight.add(task)
        try:
            async with self.lock:
                if self.finished:
                    raise RequestError("the session finished", None, 401, "authentication_error")
                yield
        finally:
            self.in_flight.discard(task)

    # -- prompts ------------------------------------------------------------------------
    def prompt_for(self, request: ChatRequest) -> Prompt:
        """The engine prompt of ``request`` (see the module doc); ``RequestError`` when the
        template cannot render its messages."""
        tools = self.tools_for(request)
        return self._rendering(
            lambda: self.conversation.propose(
                list(request.messages), tools, lambda: self._tool_set(tools)
            )
        )

    def tools_for(self, request: ChatRequest) -> tuple[dict[str, Any], ...]:
        """The tools ``request`` is rendered with: its own, or with ``keep_tools`` and
        none sent, the session's last ones (see the module doc)."""
        if request.tools or not self.keep_tools:
            return request.tools
        return self.conversation.tools

    @staticmethod
    def _tool_set(schemas: tuple[dict[str, Any], ...]) -> ToolSet:
        try:
            return tool_set(list(schemas))
        except ValueError as exc:
            raise RequestError(f"tools: {exc}", "tools") from exc

    @staticmethod
    def _rendering(render: Callable[[], Any]) -> Any:
        try:
            return render()
        except RequestError:
            raise
        except (TypeError, ValueError, KeyError) as exc:
            raise RequestError(
                f"the chat template could not render these messages: {exc}", "messages"
            ) from exc
        except Exception as exc:  # jinja's TemplateError and raise_exception(...)
            if type(exc).__module__.startswith("jinja2"):
                raise RequestError(
                    f"the chat template refused these messages: {exc}", "messages"
                ) from exc
            raise

    def prepare(
        self,
        request: ChatRequest,
        max_length: int,
        outputs: Mapping[str, Any] | None = None,
        json_calls: bool = False,
    ) -> Call:
        """The call of ``request``: its engine prompt and sampling (``outputs``: a forced
        call's grammar, ``json_calls``: its call comes as JSON); ``RequestError`` when the
        prompt leaves no room within ``max_length`` (images count expanded), or it holds
        images and the session's conversation has none."""
        if not self.images and (where := image_parts(request.messages)):
            raise RequestError(
                f"{where[0]}: this session cannot take images: no image conversation is "
                "registered; import rollpipe.vision.conversation (the vision extra) "
                "before opening the session",
                where[0],
            )
        prompt = self.prompt_for(request)
        length = getattr(prompt, "seen_length", len(prompt.ids))  # images expanded
        budget = max_length - length
        if budget < 1:
            raise RequestError(
                f"the prompt has {length} tokens, max_length is {max_length}: shorten the messages",
                "messages",
                code="context_length_exceeded",
            )
        return Call(request, prompt, self.sampling(request, budget, outputs), json_calls)

    # -- generating ---------------------------------------------------------------------
    def sampling(
        self, request: ChatRequest, budget: int, outputs: Mapping[str, Any] | None
    ) -> SamplingParams:
        """The call's sampling: the request's own fields over the door's, ``max_tokens``
        within ``budget``, logprobs on, ``outputs`` (a forced call's grammar) if any."""
        wanted = dict(request.sampling)
        if outputs is not None:
            wanted["structured_outputs"] = outputs
        try:
            return self.conversation.turn_sampling(budget, {**wanted, "logprobs": True})
        except ValueError as exc:
            raise RequestError(str(exc), None) from exc

    async def generate(
        self, engine: Engine, settings: EpisodeSettings, call: Call, on_tokens: OnTokens = None
    ) -> tuple[Generation, str]:
        """The call's answer and its text, cut at the request's ``stop`` strings
        (``stops.py``). Its engine request is held while the pipeline is suspended, kept
        on the session's rank, within ``settings``' limits; ``on_tokens`` sees its ids
        as they come (streamed)."""
        try:
            gen = await self.conversation.generate(
                engine,
                call.prompt.ids,
                call.params,
                admit=self.admit,
                max_aborts=settings.max_aborts,
                timeout_s=settings.generation_timeout_s,
                on_tokens=on_tokens,
            )
        except ImageTokenError as exc:  # the engine read other tokens than the row holds
            raise EngineError(str(exc)) from exc
        decode = self.chat.decode_for_parsing
        gen, cut = cut_at_stop(gen, call.request.stop, decode)
        return gen, decode(list(gen.token_ids)) if cut is None else cut

    # -- recording ----------------------------------------------------------------------
    def record(
        self, call: Call, gen: Generation, text: str, shown: Mapping[str, Any] | None = None
    ) -> tuple[AssistantAction, dict[str, Any]]:
        """Add the answered call to the session (``gen`` and its ``text`` as
        :meth:`generate` gives them); the parsed response and its assistant message.
        ``shown``: the message the client got when not the parsed one (streamed)."""
        request, prompt = call.request, call.prompt
        dialog = prompt.dialog  # the conversation up to this call's prompt
        dialog.messages[: len(request.messages)] = request.messages  # equal dicts; the
        # same objects let the next call's prefix check compare them by identity
        if call.json_calls:
            action = forced_action(text, request.tool_choice, request.tool_name, self.calls)
        elif request.tool_choice == "none" or dialog.parser is None:
            action = AssistantAction.plain(text)
        else:
            action = dialog.parser.parse(text, self.calls)
        dialog.messages.append(action.message() if shown is None else dict(shown))
        message = normalise_message(dialog.messages[-1], "response")
        dialog.messages[-1] = message
        self.conversation.adopt(prompt, gen)
        self.conversation.record(
            prompt.added,
            gen,
            action.text,
            messages_text([_shown(m) for m in prompt.new]),
            reward=0.0,
            action_valid=None if not request.tools else not action.malformed,
            prefix_break=prompt.new_row,
            new_row=prompt.new_row,
            constrained=call.constrained,
        )
        self.tool_calls += len(action.tool_calls)
        self.malformed += action.malformed
        return action, message

    # -- the result ---------------------------------------------------------------------
    def trajectory(
        self,
        reward: float,
        *,
        success: bool = False,
        end_reason: EndReason = "terminated",
        error: BaseException | str | None = None,
        error_call: str | None = None,
        metrics: Mapping[str, float] | None = None,
        env_id: int = 0,
    ) -> Trajectory:
        """The session's rows as a Trajectory; ``reward`` goes on the last turn."""
        turns = self.conversation.turns  # later rows start with a new_row turn
        if turns:
            turns[-1] = attrs.evolve(turns[-1], reward=reward)
        text = None if error is None else str(error) if isinstance(error, str) else repr(error)
        if text is not None:
            text = (
                f"{text[:500]} ({error_call or 'agent'}: episode {self.spec.episode_id}, "
                f"seed {self.spec.seed}, call {self.calls})"
            )
        return self.conversation.trajectory(
            score=reward if turns else 0.0,
            env_id=env_id,
            success=success,
            end_reason="error" if text is not None else end_reason,
            error=text,
            env_metrics={
                "prefix_breaks": float(self.prefix_breaks),
                "tool/calls": float(self.tool_calls),
                "tool/malformed": float(self.malformed),
                **(metrics or {}),
            },
            error_type=None if text is None or isinstance(error, str) else type(error).__name__,
            error_call=None if text is None else (error_call or "agent"),
        )


def _shown(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as ``messages_text`` shows it (tool results prefixed with the tool, an
    image as ``<image WxH>``)."""
    content = message.get("content") or ""
    shown = content if isinstance(content, list) else str(content)
    out = {"role": str(message["role"]), "content": shown}
    if message.get("name"):
        out["name"] = str(message["name"])
    return out
