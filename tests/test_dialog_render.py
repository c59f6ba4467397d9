"""Dialog's window renders (agent/dialog.py): random append-only conversations on the
tiny model's template and on the tools model's template, with and without tools and a
system message. The ids the dialog sends, turn after turn, must equal one fresh
``apply_chat_template`` of the whole conversation and the ids of a dialog that renders
the whole conversation every turn; past the checked turns, no render may see more than
the head, the last assistant turn and the new messages (the cost does not grow)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tool_support import add, divide, tools_model_path

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.dialog import CHECKED_TURNS, Dialog
from rollpipe.agent.tools import ToolSet
from rollpipe.training.tiny_model import TOOLS_CHAT_TEMPLATE

WORD = st.text(alphabet="abcdefghij KLM.,!?0123\n", max_size=12).map(lambda s: "A" + s)
CONTENT = st.one_of(st.just(""), WORD)
CALL = st.tuples(
    st.sampled_from(["add", "divide"]),
    st.fixed_dictionaries({"a": st.integers(-99, 999), "b": st.integers(0, 99)}),
)
# one turn: the assistant's content and calls, whether the response was cut before its
# end-of-turn token, the tool results' texts, and the user messages after them
TURN = st.tuples(
    CONTENT,
    st.lists(CALL, max_size=3),
    st.booleans(),
    st.lists(WORD, min_size=3, max_size=3),
    st.lists(WORD, max_size=2),
)
FIRST = st.one_of(WORD, st.lists(WORD, min_size=1, max_size=2))
FIXTURE_OK = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Turn headers numbered by position: append-only, but a window renders them otherwise.
NUMBERED_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + ' ' + loop.index|string + '\\n' + (m['content'] or '')"
    " + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant ' + (messages|length + 1)|string + '\\n' }}{%- endif %}"
)

# The tools template, with a mark on the conversation's first tool result only (as
# DeepSeek-V3's template opens its tool-outputs block once): a window without the
# first tool result would mark the new one.
_RESULT = "{{- '\\n<tool_response>\\n' + message['content']"
assert _RESULT in TOOLS_CHAT_TEMPLATE
FIRST_RESULT_TEMPLATE = "{%- set ns = namespace(seen=false) %}" + TOOLS_CHAT_TEMPLATE.replace(
    _RESULT,
    "{%- if not ns.seen %}{{- '<first>' }}{%- set ns.seen = true %}{%- endif %}" + _RESULT,
)


# The tools template, with a mark after a conversation's closing assistant turn (as
# templates that end a finished conversation with an end-of-sequence text): a
# conversation closed after the response renders otherwise than one that goes on.
_CLOSE = "{%- endfor %}{{- '<|im_end|>\\n' }}"
assert _CLOSE in TOOLS_CHAT_TEMPLATE
CLOSING_MARK_TEMPLATE = TOOLS_CHAT_TEMPLATE.replace(
    _CLOSE,
    _CLOSE + "{%- if loop.last and not add_generation_prompt %}{{- '<final>' }}{%- endif %}",
)


@pytest.fixture(scope="module")
def formats(tokenizer: Any) -> dict[str, ChatFormat]:
    """The tiny model's template (no parsers) and the tools model's (hermes), each with
    the default system prompt and with none."""
    from transformers import AutoTokenizer

    tools_tokenizer = AutoTokenizer.from_pretrained(str(tools_model_path()))
    assert tools_tokenizer.chat_template == TOOLS_CHAT_TEMPLATE
    numbered = copy.deepcopy(tokenizer)
    numbered.chat_template = NUMBERED_TEMPLATE
    out = {}
    for system in ("default", "none"):
        prompt: dict[str, Any] = {} if system == "default" else {"system_prompt": None}
        out[f"tiny/{system}"] = ChatFormat(tokenizer, **prompt)
        out[f"tools/{system}"] = ChatFormat(tools_tokenizer, tool_parser="hermes", **prompt)
    out["numbered"] = ChatFormat(numbered)
    first_result = copy.deepcopy(tools_tokenizer)
    first_result.chat_template = FIRST_RESULT_TEMPLATE
    out["first result"] = ChatFormat(first_result, tool_parser="hermes")
    closing = copy.deepcopy(tools_tokenizer)
    closing.chat_template = CLOSING_MARK_TEMPLATE
    out["closing mark"] = ChatFormat(closing, tool_parser="hermes")
    return out


class Recording(Dialog):
    """A Dialog that notes how many messages each render was given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sizes: list[int] = []
        self.prompted: list[bool] = []  # each render's generation prompt
        self.renders: list[list[bool]] = []  # per turn: its renders' generation prompts
        self.widest: list[tuple[int, int]] = []

    def _render(self, messages: Any, generation_prompt: bool) -> str:
        self.sizes.append(len(messages))
        self.prompted.append(generation_prompt)
        return super()._render(messages, generation_prompt)


def assistant_message(content: str, calls: list[Any], turn: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{turn}_{i}",
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(a)},
            }
            for i, (n, a) in enumerate(calls)
        ]
    return message


def model_ids(chat: ChatFormat, dialog: Dialog, message: dict[str, Any], cut: bool) -> list[int]:
    """The model's ids: what the template renders for ``message`` through its end of turn
    (``cut``: without the end-of-turn token, as a response cut by the length limit)."""
    tools = dialog.tools.schemas
    before = chat.render_messages(dialog.messages, generation_prompt=True, tools=tools)
    after = chat.render_messages([*dialog.messages, message], generation_prompt=False, tools=tools)
    assert after.startswith(before)
    text = after[len(before) :]
    end = text.rindex("<|im_end|>") + (0 if cut else len("<|im_end|>"))
    return chat.encode(text[:end])


def play(
    chat: ChatFormat,
    tools: ToolSet,
    first: Any,
    turns: list[Any],
    **options: Any,
) -> tuple[Recording, list[int], list[list[int]], list[bool]]:
    """One conversation: the dialog, its ids, each turn's appended ids, each turn's break;
    ``dialog.widest`` holds, per turn, the most messages a render was given and the
    size of the conversation with the new messages."""
    dialog = Recording(chat, tools, **options)
    widest: list[tuple[int, int]] = []
    observation = (
        first if isinstance(first, str) else [{"role": "user", "content": w} for w in first]
    )
    ids = dialog.first_prompt(observation)
    added, breaks = [], []
    for t, (content, calls, cut, results, users) in enumerate(turns):
        if not chat.parses_responses:  # the tiny template shows no calls: plain text turns
            calls = []
        response = model_ids(chat, dialog, assistant_message(content, calls, t), cut)
        action = dialog.act(response, t)
        new = [
            {"role": "tool", "content": results[i], "tool_call_id": c.id, "name": c.name}
            for i, c in enumerate(action.tool_calls)
        ]
        new += [{"role": "user", "content": u} for u in users]
        if not new:  # a turn always gets an answer
            new = [{"role": "user", "content": results[0]}]
        done = len(dialog.sizes)
        more, broke = dialog.continuation(new, response)
        widest.append((max(dialog.sizes[done:], default=0), len(dialog.messages)))  # 0: kept
        dialog.renders.append(dialog.prompted[done:])
        ids = [*ids, *response, *more]
        added.append(more)
        breaks.append(broke)
    dialog.widest = widest
    return dialog, ids, added, breaks


@FIXTURE_OK
@given(
    name=st.sampled_from(["tiny/default", "tiny/none", "tools/default", "tools/none"]),
    with_tools=st.booleans(),
    first=FIRST,
    turns=st.lists(TURN, min_size=1, max_size=12),
)
def test_window_renders_equal_a_fresh_render_of_the_whole_conversation(
    formats: dict[str, ChatFormat], name: str, with_tools: bool, first: Any, turns: list[Any]
) -> None:
    chat = formats[name]
    tools = ToolSet([add, divide] if with_tools else [])
    dialog, ids, added, breaks = play(chat, tools, first, turns)
    fresh = chat.encode(
        chat.render_messages(dialog.messages, generation_prompt=True, tools=tools.schemas)
    )
    assert ids == fresh
    assert not any(breaks) and dialog.prefix_breaks == 0 and not dialog.full_render
    whole, whole_ids, whole_added, whole_breaks = play(chat, tools, first, turns, full_render=True)
    assert (whole_ids, whole_added, whole_breaks) == (ids, added, breaks)
    assert dialog.messages == whole.messages and dialog.text == whole.text
    # whole renders: while the window would hold it all (2 turns after each head) and on
    # the checked turns; the head grows once, at the first tool result. The other turns
    # render at most head + last exchange + new messages.
    whole_turns = [w == n for w, n in dialog.widest]
    assert sum(whole_turns[1:]) <= 2 * (2 + CHECKED_TURNS)
    roles = [m["role"] for m in dialog.messages]
    at = roles.index("tool") if "tool" in roles else roles.index("user")
    head = at + 1  # through the first tool result, else the first user message
    most_new = 5  # 3 tool results and 2 user messages
    assert all(w <= head + (1 + most_new + 1) + most_new for w, n in dialog.widest if w < n)


def test_renders_stop_growing_after_the_checked_turns(formats: dict[str, ChatFormat]) -> None:
    """60 tool turns: after the checked turns, every render is of at most 8 messages,
    whatever the history's length."""
    chat = formats["tools/default"]
    turns = [("", [("add", {"a": t, "b": 1})], False, ["A1", "A2", "A3"], []) for t in range(60)]
    dialog, ids, _, breaks = play(chat, ToolSet([add]), "Add.", turns)
    assert ids == chat.encode(
        chat.render_messages(dialog.messages, generation_prompt=True, tools=dialog.tools.schemas)
    )
    assert not any(breaks) and len(dialog.messages) == 2 + 2 * 60
    widest = [w for w, _ in dialog.widest]
    # turns 0-2: the window would be the whole conversation; then CHECKED_TURNS checked
    assert widest[: 3 + CHECKED_TURNS] == [4 + 2 * t for t in range(3 + CHECKED_TURNS)]
    # then windows only: system, user, first call, its result, the exchange before the
    # last (call, result), the last call, the new result
    assert max(widest[3 + CHECKED_TURNS :]) == 8


def test_a_template_that_renders_the_window_otherwise_falls_back_to_whole_renders(
    formats: dict[str, ChatFormat],
) -> None:
    """Headers numbered by position: the window's numbers differ, the first checked turn
    sees it, and the dialog renders the whole conversation from then on (rows exact)."""
    chat = formats["numbered"]
    turns = [(f"A{t}", [], False, ["A1", "A2", "A3"], ["Ask"]) for t in range(6)]
    dialog, ids, _, breaks = play(chat, ToolSet(), "Go.", turns)
    assert dialog.full_render and not any(breaks)
    assert ids == chat.encode(chat.render_messages(dialog.messages, generation_prompt=True))
    assert max(dialog.sizes[-2:]) == len(dialog.messages)  # the last turn rendered the whole


def test_the_head_holds_the_first_tool_result(formats: dict[str, ChatFormat]) -> None:
    """A template that marks the first tool result of the conversation: the window holds
    that result in its head, so window turns render as whole ones (no fallback), also
    where the last exchange before a call holds no tool result."""
    chat = formats["first result"]
    calls = [[("add", {"a": t, "b": 1})] if t % 2 == 0 else [] for t in range(12)]
    turns = [("", calls[t], False, ["A1", "A2", "A3"], []) for t in range(12)]
    dialog, ids, _, breaks = play(chat, ToolSet([add]), "Add.", turns)
    rendered = chat.render_messages(
        dialog.messages, generation_prompt=True, tools=dialog.tools.schemas
    )
    assert rendered.count("<first>") == 1 and ids == chat.encode(rendered)
    assert not any(breaks) and not dialog.full_render
    assert max(w for w, _ in dialog.widest[3 + CHECKED_TURNS :]) == 8


def test_a_turn_renders_once_and_a_closing_mark_is_no_break(
    formats: dict[str, ChatFormat],
) -> None:
    """A new window turn renders the window with the new messages once: where that starts
    with the row's own text of the window and the response as written, its rest is the
    appended text and the row is that render (no render of the prompt before the
    response, nor of the conversation closed after it). A template that marks a closing
    assistant turn renders that closed conversation otherwise, and it is no break: the
    rows equal a fresh render of the whole conversation."""
    for name in ("tools/default", "closing mark"):
        chat = ChatFormat(formats[name].tokenizer, tool_parser="hermes")  # nothing kept
        turns = [
            ("", [("add", {"a": t, "b": 1})], False, [f"A{t}", "B", "C"], []) for t in range(12)
        ]
        dialog, ids, _, breaks = play(chat, ToolSet([add]), "Add.", turns)
        rendered = chat.render_messages(
            dialog.messages, generation_prompt=True, tools=dialog.tools.schemas
        )
        assert ids == chat.encode(rendered) and "<final>" not in rendered
        assert not any(breaks) and dialog.prefix_breaks == 0 and not dialog.full_render
        closed = chat.render_messages(
            dialog.messages[:-3], generation_prompt=False, tools=dialog.tools.schemas
        )
        assert closed.endswith("<final>") == (name == "closing mark")
        # past the checked turns: one render a turn, with the new messages
        assert dialog.renders[3 + CHECKED_TURNS :] == [[True]] * (9 - CHECKED_TURNS)
