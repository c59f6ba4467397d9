"""Token-exact rows of random tool conversations on three templates: the tiny model's
tools template (results in a user turn), one that gives results their own ``ipython``
role, and one that is not append-only (it drops reasoning before the last user turn).

The model's text of each turn is what the template renders for that assistant message,
so where the template is append-only the turns' ids must equal one fresh
``apply_chat_template`` of the whole conversation; where it is not, every break must be
flagged (and only then may the ids differ).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tool_support import add, divide, tools_model_path

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.dialog import Dialog
from rollpipe.agent.tools import ToolSet
from rollpipe.training.tiny_model import TOOLS_CHAT_TEMPLATE

IPYTHON_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>tools\\n' }}{%- for t in tools %}"
    "{{- t['function']['name'] + '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{{- '<|im_start|>ipython\\n' + m['name'] + ': ' + m['content'] + '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m['content'] or '') }}"
    "{%- for c in m.get('tool_calls') or [] %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' "
    "+ (c['function']['arguments'] | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_KEEP = "{%- if message.get('reasoning_content') is string %}"
assert _KEEP in TOOLS_CHAT_TEMPLATE
DROPPING_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    + TOOLS_CHAT_TEMPLATE.replace(
        _KEEP, "{%- if message.get('reasoning_content') is string and loop.index0 > ns.last %}"
    )
)
TEMPLATES = {
    "tools": TOOLS_CHAT_TEMPLATE,
    "ipython": IPYTHON_TEMPLATE,
    "dropping": DROPPING_TEMPLATE,
}

WORD = st.text(alphabet="abcdefghij KLM.,!?0123", max_size=12).map(lambda s: "A" + s)
CONTENT = st.one_of(st.just(""), WORD)
ARGS = st.fixed_dictionaries({"a": st.integers(-99, 999), "b": st.integers(0, 99)})
CALL = st.tuples(st.sampled_from(["add", "divide"]), ARGS)
TURN = st.tuples(CONTENT, st.lists(CALL, max_size=3), WORD, st.lists(WORD, min_size=3, max_size=3))
FIXTURE_OK = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def formats() -> dict[str, ChatFormat]:
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(str(tools_model_path()))
    out = {}
    for name, template in TEMPLATES.items():
        tokenizer = copy.deepcopy(base)
        tokenizer.chat_template = template
        reasoning = "qwen3" if name == "dropping" else None
        out[name] = ChatFormat(tokenizer, tool_parser="hermes", reasoning_parser=reasoning)
    return out


def assistant_message(
    content: str, calls: list[Any], reasoning: str | None, turn: int
) -> dict[str, Any]:
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
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def rendered_response(chat: ChatFormat, dialog: Dialog, message: dict[str, Any]) -> list[int]:
    """The model's ids: what the template renders for ``message``, through end of turn."""
    tools = dialog.tools.schemas
    before = chat.render_messages(dialog.messages, generation_prompt=True, tools=tools)
    after = chat.render_messages([*dialog.messages, message], generation_prompt=False, tools=tools)
    assert after.startswith(before)
    text = after[len(before) :]
    return chat.encode(text[: text.rindex("<|im_end|>") + len("<|im_end|>")])


@FIXTURE_OK
@given(
    name=st.sampled_from(sorted(TEMPLATES)),
    turns=st.lists(TURN, min_size=1, max_size=12),
    first=WORD,
)
def test_rows_equal_a_fresh_render_or_the_break_is_flagged(
    formats: dict[str, ChatFormat], name: str, turns: list[Any], first: str
) -> None:
    chat = formats[name]
    dialog = Dialog(chat, ToolSet([add, divide]))
    ids = dialog.first_prompt(first)
    breaks = []
    for t, (content, calls, reasoning, replies) in enumerate(turns):
        thought = reasoning if name == "dropping" else None
        response = rendered_response(chat, dialog, assistant_message(content, calls, thought, t))
        action = dialog.act(response, t)
        assert (action.content, action.reasoning, action.parse_error) == (content, thought, None)
        assert [(c.name, c.kwargs) for c in action.tool_calls] == calls
        if calls:
            new = [
                {"role": "tool", "content": replies[i], "tool_call_id": c.id, "name": c.name}
                for i, c in enumerate(action.tool_calls)
            ]
        else:
            new = [{"role": "user", "content": replies[0]}]
        more, broke = dialog.continuation(new, response)
        breaks.append(broke)
        ids = [*ids, *response, *more]
    fresh = chat.encode(
        chat.render_messages(dialog.messages, generation_prompt=True, tools=dialog.tools.schemas)
    )
    assert (ids == fresh) == (not any(breaks))
    assert dialog.prefix_breaks == sum(breaks)
    if name != "dropping":
        assert not any(breaks)
    else:  # the reasoning shown so far is dropped exactly when a user turn follows
        assert breaks == [not calls for _, calls, _, _ in turns]
