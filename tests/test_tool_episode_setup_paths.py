"""A tool episode's setup shortcuts give what the general paths give (issue 38).

* a callable's tool schema is made once per callable (``tools._schema_of_callable``):
  the kept one equals transformers' ``get_json_schema``, each ``ToolSet`` gets its own
  copy, and a changed docstring makes it again;
* ``ToolSet.key`` (made once) is the schemas' sorted JSON, as ``tools_key`` gives it;
* response parsers are shared by the formats of one tokenizer (``for_env``'s variants)
  and parse as a parser built afresh does;
* ``ToolCall.kwargs``'s plain-scalar path equals the ``thaw`` path, for any JSON object.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_support import tools_model_path

from rollpipe._utils.freeze import thaw
from rollpipe.agent.actions import ToolCall
from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.parsers import ResponseParser
from rollpipe.agent.repeats import tools_key
from rollpipe.agent.tools import ToolSet


def scale(x: float, times: int = 2) -> float:
    """Scale a number.

    Args:
        x: the number
        times: the factor
    """
    return x * times


@pytest.fixture(scope="module")
def tools_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tools_model_path()))


def test_a_kept_schema_is_get_json_schema_and_each_set_gets_its_own() -> None:
    from transformers.utils import get_json_schema

    first, second = ToolSet([scale]), ToolSet([scale])
    assert first.schemas == second.schemas == (get_json_schema(scale),)
    first.schemas[0]["function"]["description"] = "changed"  # one set's copy only
    assert ToolSet([scale]).schemas == (get_json_schema(scale),)


def test_a_changed_docstring_makes_the_schema_again() -> None:
    from transformers.utils import get_json_schema

    def shout(text: str) -> str:
        """Shout.

        Args:
            text: what to shout
        """
        return text.upper()

    before = ToolSet([shout]).schemas[0]
    shout.__doc__ = "Whisper.\n\n    Args:\n        text: what to whisper\n    "
    after = ToolSet([shout]).schemas[0]
    assert after == get_json_schema(shout) and after != before
    assert after["function"]["description"] == "Whisper."


def test_tool_set_key_is_the_sorted_json_of_its_schemas() -> None:
    tools = ToolSet([scale, {"type": "function", "function": {"name": "look"}}])
    expected = json.dumps(list(tools.schemas), sort_keys=True, default=repr)
    assert tools.key == expected == tools_key(tools) == tools_key(list(tools.schemas))
    assert tools.key is tools.key  # made once


def test_parsers_are_shared_by_a_tokenizers_formats_and_parse_alike(tools_tokenizer: Any) -> None:
    chat = ChatFormat(tools_tokenizer, tool_parser="hermes")
    variant = chat.for_env(type("Env", (), {"system_prompt": "Use the tools."})())
    assert variant is not chat
    tools = ToolSet([scale])
    shared = chat.response_parser(tools.schemas, tools.key)
    assert variant.response_parser(tools.schemas) is shared
    assert ChatFormat(tools_tokenizer).parses_responses is False
    fresh = ResponseParser(tools_tokenizer, "hermes", None, [dict(s) for s in tools.schemas])
    text = 'Scaling.<tool_call>\n{"name": "scale", "arguments": {"x": 1.5}}\n</tool_call>'
    for turn in (0, 3):
        assert shared.parse(text, turn) == fresh.parse(text, turn)
    assert shared.parse("<tool_call>{oops</tool_call>") == fresh.parse(
        "<tool_call>{oops</tool_call>"
    )


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6), JSON, max_size=5))
def test_call_kwargs_equal_the_thawed_arguments(arguments: dict[str, Any]) -> None:
    call = ToolCall.from_json("call_0_0", "f", json.dumps(arguments))
    slow = dict(thaw(call.arguments, "ToolCall"))
    fast = call.kwargs
    assert fast == slow and [type(v) for v in fast.values()] == [type(v) for v in slow.values()]
    assert list(fast) == list(slow)
    assert fast is not call.kwargs  # a fresh dict each time: a tool may change its own


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: what to repeat
    """
    return text


echo.blocking = False  # type: ignore[attr-defined]

CALLS = st.builds(
    ToolCall.from_json,
    st.just("call_0_0"),
    st.sampled_from(["echo", "scale", "nope"]),
    st.one_of(
        st.dictionaries(st.sampled_from(["text", "x", "times"]), JSON, max_size=3).map(json.dumps),
        st.just("[1]"),
        st.just("{oops"),
    ),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(CALLS, min_size=1, max_size=6), st.data())
def test_a_kept_call_check_is_the_check(calls: list[ToolCall], data: st.DataObject) -> None:
    from rollpipe.agent.tool_runner import ToolRunner

    runner = ToolRunner(ToolSet([echo, scale]))
    try:
        for _ in range(2 * len(calls)):  # calls again and again, as a group repeats them
            call = data.draw(st.sampled_from(calls))
            kept = runner._checked(call, call.kwargs)
            assert kept == runner._problem(call, call.kwargs)
            again = ToolCall.from_json(call.id, call.name, call.arguments_json)  # not kept
            assert runner._checked(again, again.kwargs) == kept
    finally:
        runner.close()


SANDBOX_TEMPLATES = [
    # loop attributes, dict and str methods, as chat templates read them
    "{%- for m in messages %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}"
    "{{ m.get('role') }}{{ m.get('name', 'none') }}{{ m['content'].strip().upper() }}"
    "{{ m['content'].startswith('a') }}{{ m['content'].split(' ') | length }}"
    "{%- if loop.nextitem is defined %}+{% endif %}{{ loop.cycle('x', 'y') }}{%- endfor %}"
    "{{ messages | length }}{{ messages[0].items() | list | length }}",
    # the sandbox's str.format wrap, by attribute and by item
    "{%- for m in messages %}{{ '{}: {}'.format(m['role'], m['content']) }}"
    "{{ '{r}'.format_map({'r': m['role']}) }}{{ m['content'].format() }}{%- endfor %}",
    # unsafe: a dict's mutating method, a private attribute
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ messages[0].__class__ }}",
    "{{ messages[0].pop('role') }}",
]


@settings(max_examples=60, deadline=None)
@given(
    which=st.integers(0, len(SANDBOX_TEMPLATES) - 1),
    contents=st.lists(st.text(max_size=12), min_size=1, max_size=4),
    generation_prompt=st.booleans(),
)
def test_the_renders_reads_and_calls_are_the_sandboxs(
    tools_tokenizer: Any, which: int, contents: list[str], generation_prompt: bool
) -> None:
    import copy

    from rollpipe.agent.template import template_renderer

    tokenizer = copy.copy(tools_tokenizer)
    tokenizer.chat_template = SANDBOX_TEMPLATES[which]
    render = template_renderer(tokenizer)
    assert render is not None
    messages = [
        {"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)
    ]

    def outcome(fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # the sandbox refuses: the same refusal
            return type(exc).__name__, str(exc)

    fast = outcome(lambda: render(messages, generation_prompt, None))
    slow = outcome(
        lambda: tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    )
    assert fast == slow
    assert messages[0]["role"] == "user"  # nothing changed them
