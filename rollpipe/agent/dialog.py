"""Dialog: a chat env's conversation kept token-exact, turn by turn.

The engine's prompt at each turn is the previous prompt, the model's own response ids
(never re-tokenized) and the ids of what the template renders for the new messages.
That last part comes from a render diff: the whole conversation is rendered (with the
env's ``tools=``) before and after the new messages are added, and the text after the
first render is appended, preceded by what the template writes after the assistant's
own text (e.g. ``"\\n"`` after ``<|im_end|>``; the end-of-turn token itself when the
response was cut before it). Concatenated, the turns are what a fresh
``apply_chat_template`` of the whole conversation gives, wherever the template renders
the model's response as the model wrote it.

Prefix breaks. A template that is not append-only (e.g. one that drops the reasoning
of earlier assistant turns once a new user turn comes) renders the history differently
once messages are added. rollpipe then **continues the exact tokens** — the model's
tokens and everything already sent stay as they were, so the row is still exactly
what the engine saw — and appends the new messages as the template renders them right
after an assistant turn. The turn records
``prefix_break=True``: the row differs from a fresh render of the whole conversation
(which the model never saw), and a trainer that re-renders would train on other tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollpipe.agent.actions import AssistantAction
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.messages import as_messages
from rollpipe.agent.parsers import ResponseParser
from rollpipe.agent.tools import ToolSet

__all__ = ["Dialog"]

_SENTINEL = "XQZSENTINELZQX"
Observation = str | Sequence[Mapping[str, str]]


class Dialog:
    """One chat episode's messages and the template text of its prompt so far.

    ``first_prompt(observation)`` gives turn 0's ids; ``act(response_ids, turn)`` parses
    a response into an :class:`AssistantAction` and adds it to the conversation;
    ``continuation(observation, response_ids)`` gives the ids the next turn appends and
    whether the template broke the prefix there.
    """

    def __init__(self, chat: ChatFormat, tools: ToolSet) -> None:
        if chat.history_window is not None:
            raise ValueError(
                f"history_window={chat.history_window}: chat envs (tools, message "
                "observations or step_input = 'action') run as one conversation; set "
                "history_window=None"
            )
        self.chat, self.tools = chat, tools
        self.parser: ResponseParser | None = (
            chat.response_parser(tools.schemas) if chat.parses_responses else None
        )
        self.messages: list[dict[str, Any]] = chat.system_messages()
        self.text = ""  # the template's rendering of the conversation's prompt so far
        self.prefix_breaks = 0

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        return self.chat.render_messages(
            messages, generation_prompt=generation_prompt, tools=self.tools.schemas
        )

    def first_prompt(self, observation: Observation) -> list[int]:
        """Turn 0: system message, the env's first messages, the generation prompt."""
        self.messages.extend(as_messages(observation))
        self.text = self._render(self.messages, True)
        return self.chat.encode(self.text)

    def act(self, response_ids: Sequence[int], turn: int) -> AssistantAction:
        """The response as an action (the model's parsers), added to the conversation."""
        text = self.chat.decode_for_parsing(response_ids)
        action = (
            AssistantAction.plain(text) if self.parser is None else self.parser.parse(text, turn)
        )
        self.messages.append(action.message())
        return action

    def continuation(
        self, observation: Observation, response_ids: Sequence[int]
    ) -> tuple[list[int], bool]:
        """The ids appended after ``response_ids`` for the env's new messages, and whether
        the template broke the prefix (see the module doc)."""
        new = as_messages(observation)
        closed = self._render(self.messages, False)
        whole = self._render([*self.messages, *new], True)
        broke = not (closed.startswith(self.text) and whole.startswith(closed))
        if broke:
            self.prefix_breaks += 1
            text = self._after_assistant(new, response_ids, generation_prompt=True)
        else:
            assistant = closed[len(self.text) :]
            said = str(self.chat.tokenizer.decode(list(response_ids), skip_special_tokens=False))
            if assistant.startswith(said):  # the template renders the response as written
                closer = assistant[len(said) :]
            else:
                closer = self._after_assistant([], response_ids, generation_prompt=False)
            text = closer + whole[len(closed) :]
        self.messages.extend(new)
        self.text = whole
        return self.chat.encode(text), broke

    def _after_assistant(
        self,
        new: Sequence[Mapping[str, Any]],
        response_ids: Sequence[int],
        generation_prompt: bool,
    ) -> str:
        """What the template writes after the last assistant turn's text, then ``new``:
        rendered with that turn's text replaced by a sentinel, cut after it. The
        end-of-turn token is left out when the response already ends with it."""
        placeholder = {"role": "assistant", "content": _SENTINEL}
        messages = [*self.messages[:-1], placeholder, *new]
        rendered = self._render(messages, generation_prompt)
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
