"""Forced tool calls are made and read as vLLM's server makes and reads them: the
constraint is the one vLLM picks for the tool parser (a structural tag for ``hermes``, the
JSON schema for a parser without one, or no parser); for any arguments the model writes
as JSON, ``forced_action`` gives the calls vLLM's own ``Parser`` gives (names and
argument text; ``pythonic``, a JSON-path parser the tiny tokenizer can build); an answer
that is not the JSON asked for is malformed, never a silent call."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_support import add, divide, tools_model_path

from rollpipe.agent.tools import tool_set
from rollpipe.frontdoor.chunks import parser_class
from rollpipe.frontdoor.forced import forced_action, forced_outputs, object_tools
from rollpipe.frontdoor.requests import RequestError, parse_chat_request

TOOLS = [dict(s) for s in tool_set([add, divide]).schemas]
NAMED = {"type": "function", "function": {"name": "add"}}
VALUES = st.integers(-(10**6), 10**6) | st.floats(allow_nan=False, width=32) | st.text(max_size=6)
ARGS = st.dictionaries(st.sampled_from(["a", "b"]), VALUES, min_size=1)
_VLLM: dict[str, Any] = {}


def vllm_calls(text: str, choice: Any) -> list[tuple[str, str]]:
    """What vLLM's server makes of ``text`` for ``tool_choice=choice``."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    if not _VLLM:
        _VLLM["tok"] = AutoTokenizer.from_pretrained(str(tools_model_path()))
        _VLLM["cls"] = parser_class(_VLLM["tok"], "pythonic", None)
    make: Any = ChatCompletionRequest
    request = make(messages=[], model="m", tools=TOOLS, tool_choice=choice)
    parser = _VLLM["cls"](_VLLM["tok"], request.tools)
    _, _, calls = parser.parse(text, request, enable_auto_tools=True)
    return [(c.name, c.arguments) for c in calls or []]


@settings(deadline=None)  # the first example loads the tokenizer and vLLM's parser
@given(st.lists(st.tuples(st.sampled_from(["add", "divide"]), ARGS), min_size=1, max_size=3))
def test_required_calls_are_the_ones_vllm_reads(calls: list[tuple[str, dict[str, Any]]]) -> None:
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], ensure_ascii=False)
    action = forced_action(text, "required", None, 2)
    ours = [(c.name, c.arguments_json) for c in action.tool_calls]
    assert ours == vllm_calls(text, "required")
    assert [c.id for c in action.tool_calls] == [f"call_2_{i}" for i in range(len(calls))]
    assert not action.malformed and action.content == ""


@settings(deadline=None)
@given(ARGS)
def test_a_named_call_is_the_one_vllm_reads(arguments: dict[str, Any]) -> None:
    text = json.dumps(arguments)
    (call,) = forced_action(text + "<|endoftext|>", "function", "add", 0).tool_calls
    assert [(call.name, call.arguments_json)] == vllm_calls(text, NAMED)
    assert call.kwargs == arguments


@pytest.mark.parametrize(
    ("text", "choice"),
    [('{"a": 1', "function"), ('[{"name": "add", "param', "required"), ("[]", "required")],
)
def test_an_answer_that_is_not_the_json_asked_for_is_malformed(text: str, choice: str) -> None:
    action = forced_action(text, choice, "add" if choice == "function" else None, 0)
    assert action.malformed
    if choice == "function":  # vLLM keeps the call, its arguments unusable
        assert [(c.name, c.arguments_json) for c in action.tool_calls] == vllm_calls(text, NAMED)
    else:  # vLLM reads no call
        assert not action.tool_calls and vllm_calls(text, "required") == []


def forced(choice: Any, parser: str | None, parallel: bool | None = None, tools: Any = None) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tools_model_path()))
    tools = TOOLS if tools is None else tools
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    body |= {"tool_choice": choice, "parallel_tool_calls": parallel}
    return forced_outputs(parse_chat_request(body), tok, parser_class(tok, parser, None))


def test_the_constraint_is_the_one_vllm_picks_for_the_parser() -> None:
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    # hermes has a structural tag: the model's own markup, the function name fixed, the
    # arguments held to the tool's schema though the tool does not say "strict"
    assert all("strict" not in t["function"] for t in TOOLS)
    outputs, json_calls = forced(NAMED, "hermes")
    tags = json.loads(outputs["structural_tag"])["format"]["tags"]
    assert tags and all(
        t["begin"].startswith("<tool_call>") and '{"name": "add", "arguments": ' in t["begin"]
        for t in tags
    )
    schema = TOOLS[0]["function"]["parameters"]
    assert all(t["content"]["json_schema"] == schema for t in tags)
    assert all(t["end"].endswith("</tool_call>") for t in tags) and not json_calls
    # a JSON-path parser, or none: vLLM's JSON schema
    for parser in ("pythonic", None):
        outputs, json_calls = forced(NAMED, parser)
        assert json_calls and outputs == {"json": TOOLS[0]["function"]["parameters"]}
    outputs, _ = forced("required", None, parallel=False)
    assert outputs["json"]["maxItems"] == 1 and outputs["json"]["minItems"] == 1
    names = {s["properties"]["name"]["enum"][0] for s in outputs["json"]["items"]["anyOf"]}
    assert names == {"add", "divide"}
    assert callable(get_json_schema_from_tools)  # what forced_outputs builds them with


@pytest.mark.parametrize("parser", ["hermes", None])
@pytest.mark.parametrize(
    ("parameters", "schema"),
    [
        (None, {"type": "object"}),  # no parameters: any object
        (
            {"properties": {"q": {"type": "string"}}},
            {"type": "object", "properties": {"q": {"type": "string"}}},
        ),
    ],
)
def test_arguments_are_an_object_even_without_an_object_schema(
    parser: str | None, parameters: Any, schema: Any
) -> None:
    function: dict[str, Any] = {"name": "look", "strict": False}  # strict or not: held
    if parameters is not None:
        function["parameters"] = parameters
    named = {"type": "function", "function": {"name": "look"}}
    outputs, _ = forced(named, parser, tools=[{"type": "function", "function": function}])
    if parser is None:
        assert outputs == {"json": schema}
    else:
        tags = json.loads(outputs["structural_tag"])["format"]["tags"]
        assert tags and all(t["content"]["json_schema"] == schema for t in tags)


def test_a_forced_call_of_a_tool_whose_schema_is_not_an_object_is_refused() -> None:
    tools = [
        TOOLS[0],
        {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}},
    ]
    with pytest.raises(
        RequestError, match=r"tools\[1\]\.function\.parameters has type 'string'"
    ) as info:
        forced("required", "hermes", tools=tools)
    assert info.value.param == "tools[1].function.parameters"
    assert object_tools(tools[:1]) == tools[:1]  # an object schema is kept as it is
