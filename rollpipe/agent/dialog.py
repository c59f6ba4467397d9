"""Dialog: a chat env's conversation kept token-exact, turn by turn.

The engine's prompt at each turn is the previous prompt, the model's own response ids
(never re-tokenized) and the ids of what the template renders for the new messages.
That last part comes from a render diff: the conversation with the new messages is
rendered (with the env's ``tools=``), and where that starts with the prompt before the
response and the response as the model wrote it, its rest is appended (it holds what the
template writes after the assistant's own text, e.g. ``"\\n"`` after ``<|im_end|>``,
or the end-of-turn token itself when the response was cut before it). Otherwise the
conversation closed after the response is rendered too, to tell a history rendered
otherwise (a prefix break, below) from a response the template writes otherwise.
Concatenated, the turns are what a fresh ``apply_chat_template`` of the whole
conversation gives, wherever the template renders the model's response as the model
wrote it.

Window renders. Rendering the whole conversation at every turn costs time that grows
with the history (Jinja walks every message), so the diff is taken on a **window**: the
conversation's head (up to its first tool result, or its first message after the system
messages while there is none) and its last exchange (the assistant turn before the last
one, the env's messages after it, the last assistant turn), then the new messages. A
template's logic that looks at the start of the conversation (a default system prompt,
a tools block in the system or first user turn, DeepSeek's first tool call and first
tool output) or at a message's neighbours (role headers, consecutive ``tool`` results
grouped under one user block, Qwen3's last user query) sees in the window what it sees
in the whole conversation, so a turn costs the same at turn 128 as at turn 8. Each
dialog checks this: the first :data:`CHECKED_TURNS` turns whose window leaves messages
out (again after the head grows) are also diffed on the whole conversation, and on any
difference (or a template error on the window) the dialog renders the whole
conversation from then on. ``Dialog(..., full_render=True)`` renders the whole
conversation at every turn.

Prefix breaks. A template that is not append-only (e.g. one that drops the reasoning
of earlier assistant turns once a new user turn comes) renders the history differently
once messages are added. rollpipe then **continues the exact tokens** — the model's
tokens and everything already sent stay as they were, so the row is still exactly
what the engine saw — and appends the new messages as the template renders them right
after an assistant turn. The turn records
``prefix_break=True``: the row differs from a fresh render of the whole conversation
(which the model never saw), and a trainer that re-renders would train on other tokens.
A template that only writes a conversation's closing assistant turn otherwise (a mark
after the last turn of a finished conversation) breaks nothing: the row is the fresh
render with the new messages.
A window render sees a break in the window: the last exchange or the head rendered
differently once the new messages come, which is where the templates that drop the
reasoning of the turns before a new user turn, or move a tools block to the last user
turn, change the history. A template that re-renders only turns the window leaves out
breaks unseen after the checked turns; ``full_render=True`` sees every break.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from rollpipe.agent.actions import AssistantAction
from rollpipe.agent.chat import ChatFormat, Packed, packed, template_message
from rollpipe.agent.env_returns import as_messages
from rollpipe.agent.parsers import ResponseParser, renumbered
from rollpipe.agent.repeats import frozen_message, repeat_key, tools_key
from rollpipe.agent.row_text import RowText
from rollpipe.agent.template import KeptJson
from rollpipe.agent.tools import ToolSet

__all__ = ["CHECKED_TURNS", "Dialog"]

CHECKED_TURNS = 2  # window renders per dialog also checked against a whole render
_SENTINEL = "XQZSENTINELZQX"
_PLACEHOLDER = {"role": "assistant", "content": _SENTINEL}  # the last turn's, cut after
Observation = str | Sequence[Mapping[str, str]]
Messages = Sequence[Mapping[str, Any]]


class Dialog:
    """One chat episode's messages and the template text of its prompt so far.

    ``first_prompt(observation)`` gives turn 0's ids; ``act(response_ids, turn)`` parses
    a response into an :class:`AssistantAction` and adds it to the conversation;
    ``continuation(observation, response_ids)`` gives the ids the next turn appends and
    whether the template broke the prefix there. ``full_render=True`` renders the
    whole conversation at every turn instead of a window (see the module doc).
    """

    def __init__(self, chat: ChatFormat, tools: ToolSet, *, full_render: bool = False) -> None:
        if chat.history_window is not None:
            raise ValueError(
                f"history_window={chat.history_window}: chat envs (tools, message "
                "observations or step_input = 'action') run as one conversation; set "
                "history_window=None"
            )
        self.chat, self.tools = chat, tools
        self.full_render = full_render
        self.parser: ResponseParser | None = (
            chat.response_parser(tools.schemas, tools.key) if chat.parses_responses else None
        )
        self.messages: list[dict[str, Any]] = chat.system_messages()
        self.prefix_breaks = 0
        self._checks_left = CHECKED_TURNS
        self._text: str | None = ""  # rendered on demand (``text``) when None
        self._text_upto = 0  # the messages ``_text`` renders
        self._head = 0  # the messages in the window's head
        self._tools_key = tools_key(tools)  # repeats are shared by dialogs with these tools
        # each message's (itself, frozen form, text size) by id: read once, as it joins
        self._marks: dict[int, tuple[Mapping[str, Any], Hashable, int]] = {}
        self._chars_seen = 0  # the text of every message marked (>= of those it holds)
        # each message's template form (``template_message``) by id, made at its first render
        self._forms: dict[int, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
        self._schemas = tuple(KeptJson(s) for s in tools.schemas)  # the tools, as rendered
        self._rows = RowText()  # the row's own text, by the messages it covers
        self._acted: Mapping[str, Any] | None = None  # the message act added last
        # (length, last message, _current_window's answer): the window found this turn
        self._window_at: tuple[int, Mapping[str, Any] | None, Any] | None = None
        self._marked(self.messages)

    @property
    def text(self) -> str:
        """The template's rendering of the conversation's prompt so far (the messages
        before the last response, with the generation prompt); rendered when asked."""
        if self._text is None:
            self._text = self._render(self.messages[: self._text_upto], True)
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self._text_upto = value, len(self.messages)

    def _render(self, messages: Messages, generation_prompt: bool) -> str:
        """``messages`` rendered (each in its template form, made once per message)."""
        forms, shown = self._forms, []
        for message in messages:
            form = forms.get(id(message))
            if form is None or form[0] is not message:
                form = forms[id(message)] = (message, template_message(message))
            shown.append(form[1])
        return self.chat.render_shown(
            shown, generation_prompt=generation_prompt, tools=self._schemas
        )

    def first_prompt(self, observation: Observation) -> list[int]:
        """Turn 0: system message, the env's first messages, the generation prompt. Kept
        by the messages and tools (a group's episodes start alike): rendered and
        tokenized once."""
        self.messages.extend(self._joined(as_messages(observation)))
        frozen = [mark[1] for mark in self._marked(self.messages)]
        key = None if None in frozen else ("first", self._tools_key, tuple(frozen))
        known: tuple[str, tuple[int, ...]] | None = (
            None if key is None else self.chat.repeats.get(key)
        )
        if known is None:
            text = self._render(self.messages, True)
            known = (text, tuple(self.chat.encode(text)))
            if key is not None:
                self.chat.repeats.put(key, known)
        self.text = known[0]
        self._rows.add(self.messages, known[0])
        return list(known[1])

    def act(self, response_ids: Sequence[int], turn: int) -> AssistantAction:
        """The response as an action (the model's parsers), added to the conversation. A
        response seen before at the same turn (a group's episodes often answer alike) is
        the same action (actions are frozen), neither decoded nor parsed again; one seen
        at another turn is renumbered (:meth:`_parsed`)."""
        key = ("act", self._tools_key, turn, tuple(response_ids))
        known: tuple[AssistantAction, Hashable, int] | None = self.chat.repeats.get(key)
        if known is None:
            action = self._parsed(response_ids, turn)
            known = (action, *self._measured(action.message()))
            self.chat.repeats.put(key, known)
        action, frozen, chars = known
        message = action.message()  # a dict of this dialog's own, marked as the kept one
        self._marks[id(message)] = (message, frozen, chars)
        self._chars_seen += chars
        self.messages.append(message)
        self._acted = message
        return action

    def _parsed(self, response_ids: Sequence[int], turn: int) -> AssistantAction:
        """The response decoded and parsed, its calls with ``turn``'s ids. Kept by the ids
        alone (the parse is a function of the text; only the call ids follow the turn):
        a response seen at another turn is renumbered, neither decoded nor parsed."""
        key = ("parsed", self._tools_key, tuple(response_ids))
        found: tuple[AssistantAction, int] | None = self.chat.repeats.get(key)
        parser = self.parser
        if found is None:
            text = self.chat.decode_for_parsing(response_ids)
            action = AssistantAction.plain(text) if parser is None else parser.parse(text, turn)
            found = (action, turn)
            self.chat.repeats.put(key, found)
        action, parsed_at = found
        return action if parsed_at == turn or parser is None else renumbered(action, turn)

    def continuation(
        self, observation: Observation, response_ids: Sequence[int]
    ) -> tuple[list[int], bool]:
        """The ids appended after ``response_ids`` for the env's new messages, and whether
        the template broke the prefix (see the module doc)."""
        (ids, _), broke = self.packed_continuation(observation, response_ids)
        return list(ids), broke

    def packed_continuation(
        self, observation: Observation, response_ids: Sequence[int]
    ) -> tuple[Packed, bool]:
        """:meth:`continuation`'s ids as a tuple and a read-only int64 array (kept with
        the text they encode: a repeated continuation is neither tokenized nor packed
        again), and the break."""
        new = as_messages(observation)
        new_frozen = [mark[1] for mark in self._marked(new)]  # marked once: they join below
        text, broke, whole = None, False, None
        span, window, frozen, _ = (None, (), (), 0) if self.full_render else self._current_window()
        if span is not None:
            try:
                text, broke, _ = self._kept_diff(
                    window, None, new, response_ids, span, (frozen, new_frozen)
                )
            except Exception:  # a template that refuses the window: render the whole
                self.full_render, text = True, None
            if text is not None and self._checks_left > 0:
                self._checks_left -= 1
                checked = self._whole_diff(new, response_ids)
                if checked[:2] != (text, broke):  # the window renders otherwise: stop using it
                    self.full_render = True
                text, broke, whole = checked
        if text is None:
            text, broke, whole = self._whole_diff(new, response_ids)
        self.prefix_breaks += broke
        acted = self.messages[-1] if self.messages else None
        self.messages.extend(new)  # marked above
        self._text, self._text_upto = whole, len(self.messages)
        if acted is not None and acted is self._acted:  # the response's own message
            self._rows.add((acted, *new), self._said(response_ids) + text)
        return self._encoded(text), broke

    def _window_row(self, head: int, last: int) -> str | None:
        """The row's own text of ``messages[:head] + messages[last:-1]`` (None: not known)."""
        row_head = self._rows.of(self.messages, 0, head)
        row_tail = self._rows.of(self.messages, last, len(self.messages) - 1)
        return None if row_head is None or row_tail is None else row_head + row_tail

    def _whole_diff(
        self, new: Messages, response_ids: Sequence[int]
    ) -> tuple[str, bool, str | None]:
        """:meth:`_diff` on the whole conversation (its prompt so far: :attr:`text`)."""
        last = len(self.messages) - 1
        span = (last, last)  # the window that leaves nothing out
        if self._text_upto == last:  # text renders all but the response
            return self._kept_diff(self.messages, None, new, response_ids, span)
        return self._kept_diff(self.messages, self.text, new, response_ids, span)

    def _kept_diff(
        self,
        history: Messages,
        prompt: str | None,
        new: Messages,
        response_ids: Sequence[int],
        span: tuple[int, int],
        frozen: tuple[Sequence[Hashable], Sequence[Hashable]] | None = None,
    ) -> tuple[str, bool, str]:
        """:meth:`_diff`, ``prompt`` (None: ``history[:-1]`` rendered) given or not; with
        None, kept by its whole input in the format's :class:`Repeats` (a group's
        episodes often take the same turn): the same result, without rendering again.

        ``history`` is ``messages[:head] + messages[last:]`` for ``span = (head, last)``
        (``frozen``: its messages' frozen numbers and ``new``'s, where known).
        Where the render with the new messages starts with the row's own text of
        ``history[:-1]`` and the response as written, the rest is the text appended (the
        row is then that render): one render, no prompt's."""
        key = None
        if prompt is None:
            if frozen is None:
                frozen = [m[1] for m in self._marked(history)], [m[1] for m in self._marked(new)]
            key = repeat_key(self._tools_key, *frozen, response_ids)
        if key is not None:
            known: tuple[str, bool, str] | None = self.chat.repeats.get(key)
            if known is not None:
                return known
        said = self._said(response_ids)
        whole = self._render([*history, *new], True)
        row = self._window_row(*span)
        if row is not None and whole.startswith(row) and whole.startswith(said, len(row)):
            result = whole[len(row) + len(said) :], False, whole
        else:
            if prompt is None:
                prompt = self._render(history[:-1], True)
            result = self._diff(history, prompt, new, said, response_ids, whole)
        if key is not None:
            self.chat.repeats.put(key, result)
        return result

    def _said(self, response_ids: Sequence[int]) -> str:
        """The response's text with its special tokens, as the template shows it (kept by
        the ids: a group's responses, and a model's, often repeat)."""
        key = ("said", tuple(response_ids))
        found: str | None = self.chat.repeats.get(key)
        if found is None:
            found = self.chat.decode_text(response_ids, skip_special_tokens=False)
            self.chat.repeats.put(key, found)
        return found

    def _encoded(self, text: str) -> Packed:
        """``text``'s ids and those packed (kept by the text)."""
        key = ("encode", text)
        found: Packed | None = self.chat.repeats.get(key)
        if found is None:
            found = packed(tuple(self.chat.encode(text)))
            self.chat.repeats.put(key, found)
        return found

    def render_chars(self, observation: Observation, limit: int = 0) -> int:
        """The characters of message content the next prompt renders: the new messages
        and what they are rendered after (the window, or the whole conversation on a
        checked turn or without a window), each counted once. The episode renders a
        prompt this big off the event loop (``ChatConversation.renders_off_loop``). Below
        ``limit``, the count may be of all messages (cheaper than finding the window)."""
        new = _chars([{"content": observation}] if isinstance(observation, str) else observation)
        messages = self.messages
        if new + self._chars_seen < limit:  # all of it is less: no need to find the window
            return new + self._chars_seen
        if not self.full_render and messages:
            span, _, _, window_chars = self._current_window()
            if span is not None and self._checks_left == 0:
                return new + window_chars
        return new + sum(mark[2] for mark in self._marked(messages))

    def _joined(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages``, marked as they join the conversation (their text counted)."""
        self._marked(messages)
        return messages

    def _marked(self, messages: Messages) -> list[tuple[Mapping[str, Any], Hashable, int]]:
        """:meth:`_mark` of each of ``messages`` (inlined: a turn reads a dozen)."""
        marks, out = self._marks, []
        for message in messages:
            mark = marks.get(id(message))
            out.append(mark if mark is not None and mark[0] is message else self._mark(message))
        return out

    def _mark(self, message: Mapping[str, Any]) -> tuple[Mapping[str, Any], Hashable, int]:
        """``(message, its frozen form's number (None: not frozen, e.g. an image), its text
        size)``, read once per message. A message is taken as it was when it joined (an
        env that changes a message it returned, after returning it, is not seen)."""
        mark = self._marks.get(id(message))
        if mark is None or mark[0] is not message:
            mark = self._marks[id(message)] = (message, *self._measured(message))
            self._chars_seen += mark[2]
        return mark

    def _measured(self, message: Mapping[str, Any]) -> tuple[Hashable, int]:
        """``message``'s frozen form's number (None: not frozen) and its text size."""
        try:
            frozen: Hashable = self.chat.repeats.number(frozen_message(message))
        except TypeError:
            frozen = None
        return frozen, _chars([message])

    def _span(self) -> tuple[int, int] | None:
        """``(head, last)``: the window is ``messages[:head] + messages[last:]``; None when
        that is the whole conversation or it does not end with an assistant turn."""
        messages = self.messages
        if not messages or messages[-1].get("role") != "assistant":
            return None
        head = next((i for i, m in enumerate(messages) if m.get("role") == "tool"), None)
        if head is None:
            head = next((i for i, m in enumerate(messages) if m.get("role") != "system"), 0)
        head += 1
        last = len(messages) - 2  # the assistant turn before the last one starts the tail
        while last >= head and messages[last].get("role") != "assistant":
            last -= 1
        return None if last <= head else (head, last)  # None: nothing left out

    def _current_window(
        self,
    ) -> tuple[tuple[int, int] | None, Messages, list[Hashable], int]:
        """``(span, window messages, their frozen numbers, their text size)`` of the
        conversation now: the head and the last exchange as :meth:`_span` gives them (see
        the module doc; span None and the window all of it where that leaves nothing
        out). A new head (the first tool result came) is checked again on its first
        turns. Kept for the conversation's length and last message: a turn's
        :meth:`render_chars` and its continuation after it find the window once."""
        messages = self.messages
        last = messages[-1] if messages else None
        kept = self._window_at
        if kept is not None and kept[0] == len(messages) and kept[1] is last:
            return kept[2]
        span = self._span()
        if span is not None and span[0] != self._head:
            self._head, self._checks_left = span[0], CHECKED_TURNS
        window = messages if span is None else [*messages[: span[0]], *messages[span[1] :]]
        marks = self._marked(window)
        found = (span, window, [m[1] for m in marks], sum(m[2] for m in marks))
        self._window_at = (len(messages), last, found)
        return found

    def _diff(
        self,
        history: Messages,
        prompt: str,
        new: Messages,
        said: str,
        response_ids: Sequence[int],
        whole: str,
    ) -> tuple[str, bool, str]:
        """The text appended after the response, whether the template broke the prefix,
        and the render of ``history`` + ``new``: ``history`` ends with the assistant turn
        and ``prompt`` is the render (with generation prompt) of what came before it.

        Where the new render starts with the prompt and the response as the model wrote
        it, the rest of it is the text appended: the row is then exactly that render, so
        nothing broke (one render). Otherwise the conversation closed after the response
        is rendered too, to tell a history rendered otherwise (a break) from a response
        the template writes otherwise. ``whole`` is the render with the new messages."""
        if whole.startswith(prompt) and whole.startswith(said, len(prompt)):
            return whole[len(prompt) + len(said) :], False, whole
        closed = self._render(history, False)
        if not (closed.startswith(prompt) and whole.startswith(closed)):
            return self._after_assistant(history, new, response_ids), True, whole
        assistant = closed[len(prompt) :]
        if assistant.startswith(said):  # the template renders the response as written
            closer = assistant[len(said) :]
        else:
            closer = self._after_assistant(history, [], response_ids, generation_prompt=False)
        return closer + whole[len(closed) :], False, whole

    def _after_assistant(
        self,
        history: Messages,
        new: Messages,
        response_ids: Sequence[int],
        generation_prompt: bool = True,
    ) -> str:
        """What the template writes after the last assistant turn's text, then ``new``:
        rendered with that turn's text replaced by a sentinel, cut after it. The
        end-of-turn token is left out when the response already ends with it."""
        rendered = self._render([*history[:-1], _PLACEHOLDER, *new], generation_prompt)
        cut = rendered.rfind(_SENTINEL)
        if cut < 0:
            raise ValueError("the chat template dropped the assistant message content")
        text = rendered[cut + len(_SENTINEL) :]
        eot = self.chat.eot_id
        if eot is not None and response_ids and response_ids[-1] == eot:
            eot_text = str(self.chat.tokenizer.convert_ids_to_tokens(eot))
            if text.startswith(eot_text):
                text = text[len(eot_text) :]
        return text


def _chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """The characters of ``messages``' text: contents (a parts list's text parts) and
    tool-call arguments."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, Sequence):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, Mapping))
        for call in m.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            arguments = function.get("arguments") if isinstance(function, Mapping) else None
            total += len(arguments) if isinstance(arguments, str) else 0
    return total
