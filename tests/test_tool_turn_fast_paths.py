"""The tool turn's fast paths give what the slow paths give, for any input (issue 38).

* ``rollpipe.agent.template``'s render equals ``apply_chat_template`` on both tiny
  templates (the tools one renders tool calls and results), tools or none;
* a message's frozen form (``rollpipe.agent.repeats``) is equal to another's exactly when
  the messages are equal with the same types throughout (``1``, ``1.0`` and ``True``
  differ: a template renders them differently);
* a dialog whose turns are kept (``ChatFormat.repeats``, shared by every dialog of a
  format) gives the ids a dialog on a fresh format (nothing kept) gives; a response
  seen at another turn is the action a fresh parse at this turn gives, without a parse;
* a tool whose schema says all its signature does (``ToolSet.bound_by_schema``) binds
  every argument set the schema check lets through, so skipping ``inspect``'s bind
  changes nothing;
* template forms whose tool schemas and call arguments keep their JSON
  (``template.KeptJson``) render as the plain dicts do, every time;
* ``ToolRunner.run_inline`` gives what ``run`` gives for calls that need no await, runs
  nothing (None) when one does, and a call checked before is checked alike;
* an env's plain messages (``check_messages``) and a step's plain metrics
  (``step_metrics``), taken on short paths, are what the general checks make of them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import pickle
import threading
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_support import tools_model_path

from rollpipe.agent.actions import AssistantAction, ToolCall
from rollpipe.agent.chat import ChatFormat, template_message
from rollpipe.agent.dialog import Dialog
from rollpipe.agent.env_caller import Clock, EnvCaller
from rollpipe.agent.env_contract import AGG_MODES, is_blocking, step_metrics
from rollpipe.agent.env_returns import check_messages
from rollpipe.agent.env_threads import EnvThreads
from rollpipe.agent.parsers import ResponseParser
from rollpipe.agent.records import EpisodeSpec
from rollpipe.agent.repeats import frozen_message
from rollpipe.agent.template import KeptJson, template_renderer
from rollpipe.agent.tool_runner import ToolRunner, argument_problem
from rollpipe.agent.tools import ToolSet
from rollpipe.envs.tool_env import ToolEnv
from rollpipe.training.tiny_model import default_model_path

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
ARGS = st.dictionaries(
    st.sampled_from(["a", "b", "text"]), st.one_of(st.integers(-9, 9), TEXT, st.booleans())
)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: what to repeat
    """
    return text


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {
        "tiny": AutoTokenizer.from_pretrained(str(default_model_path())),
        "tools": AutoTokenizer.from_pretrained(str(tools_model_path())),
    }


def call_message(name: str, arguments: dict[str, Any], i: int) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": f"call_{i}", "type": "function", "function": function}


@st.composite
def conversations(draw: Any) -> list[dict[str, Any]]:
    """A system message or none, then user / assistant (content, tool calls) / tool turns."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["user", "assistant", "calls", "tool"]))
        if kind == "calls":
            calls = [call_message(draw(st.sampled_from(["add", "echo"])), draw(ARGS), i)]
            messages.append({"role": "assistant", "content": draw(TEXT), "tool_calls": calls})
        elif kind == "tool":
            messages.append(
                {"role": "tool", "tool_call_id": f"call_{i}", "name": "echo", "content": draw(TEXT)}
            )
        else:
            messages.append({"role": kind, "content": draw(TEXT)})
    return messages


@settings(max_examples=150, deadline=None)
@given(
    which=st.sampled_from(["tiny", "tools"]),
    messages=conversations(),
    generation_prompt=st.booleans(),
    with_tools=st.booleans(),
)
def test_the_template_render_equals_apply_chat_template(
    tokenizers: dict[str, Any],
    which: str,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    with_tools: bool,
) -> None:
    tokenizer = tokenizers[which]
    render = template_renderer(tokenizer)
    assert render is not None  # both tiny tokenizers take the fast render
    tools = list(ToolSet([add, echo]).schemas) if with_tools else None
    shown = [template_message(m) for m in messages]
    slow = tokenizer.apply_chat_template(
        shown, tokenize=False, add_generation_prompt=generation_prompt, tools=tools
    )
    assert render(shown, generation_prompt, tools) == slow


def plain(value: Any) -> Any:
    """``value`` with every dict a plain ``dict`` (no ``KeptJson``)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


@settings(max_examples=100, deadline=None)
@given(messages=conversations(), generation_prompt=st.booleans())
def test_kept_json_renders_as_plain_dicts_every_time(
    tokenizers: dict[str, Any], messages: list[dict[str, Any]], generation_prompt: bool
) -> None:
    tokenizer = tokenizers["tools"]
    render = template_renderer(tokenizer)
    assert render is not None
    shown = [template_message(m) for m in messages]  # call arguments: KeptJson
    kept = [KeptJson(s) for s in ToolSet([add, echo]).schemas]
    slow = tokenizer.apply_chat_template(
        plain(shown),
        tokenize=False,
        add_generation_prompt=generation_prompt,
        tools=plain(list(ToolSet([add, echo]).schemas)),
    )
    assert render(shown, generation_prompt, kept) == slow  # dumped, then kept
    assert render(shown, generation_prompt, kept) == slow  # the kept text
    again = pickle.loads(pickle.dumps(kept))  # as a plain dict (its filter does not pickle)
    assert again == kept and all(type(s) is dict for s in again)


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(-2, 2, allow_nan=False), TEXT
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("abc"), inner, max_size=3)
    ),
    max_leaves=8,
)


def typed(value: Any) -> Any:
    """``value`` with every type spelled out, dict keys in order (what a template sees)."""
    if isinstance(value, dict):
        return ("dict", [(k, typed(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [typed(v) for v in value])
    return (type(value).__name__, value)


@settings(max_examples=300, deadline=None)
@given(
    one=st.dictionaries(st.sampled_from("xyz"), VALUES),
    other=st.dictionaries(st.sampled_from("xyz"), VALUES),
)
def test_frozen_messages_are_equal_exactly_when_the_messages_and_types_are(
    one: dict[str, Any], other: dict[str, Any]
) -> None:
    assert (frozen_message(one) == frozen_message(other)) == (typed(one) == typed(other))
    assert frozen_message(one) == frozen_message(json.loads(json.dumps(one))) or typed(
        one
    ) != typed(json.loads(json.dumps(one)))


TURN = st.tuples(
    st.sampled_from(["add", "echo", None]), ARGS, st.lists(TEXT, min_size=1, max_size=2)
)


@settings(max_examples=60, deadline=None)
@given(first=TEXT, turns=st.lists(TURN, min_size=1, max_size=8), twice=st.booleans())
def test_kept_turns_give_the_ids_of_a_dialog_with_nothing_kept(
    tokenizers: dict[str, Any], first: str, turns: list[Any], twice: bool
) -> None:
    shared = ChatFormat(tokenizers["tools"], tool_parser="hermes")
    tools = ToolSet([add, echo])

    def play(chat: ChatFormat) -> tuple[list[int], int, list[dict[str, Any]], str]:
        dialog = Dialog(chat, tools)
        ids = dialog.first_prompt(first)
        for t, (name, arguments, results) in enumerate(turns):
            message = {"role": "assistant", "content": ""}
            if name is not None:
                message["tool_calls"] = [call_message(name, arguments, t)]
            text = chat.render_messages(
                [*dialog.messages, message], generation_prompt=False, tools=tools.schemas
            )[len(dialog.text) :]
            response = chat.encode(text.rstrip("\n"))
            action = dialog.act(response, t)
            new = [
                {"role": "tool", "tool_call_id": c.id, "name": c.name, "content": results[0]}
                for c in action.tool_calls
            ] or [{"role": "user", "content": results[-1]}]
            more, _ = dialog.continuation(new, response)
            ids = [*ids, *response, *more]
        return ids, dialog.prefix_breaks, dialog.messages, dialog.text

    kept = play(shared)
    if twice:  # the second time, every turn is a kept one
        kept = play(shared)
    assert kept == play(ChatFormat(tokenizers["tools"], tool_parser="hermes"))


def test_a_response_seen_at_another_turn_is_renumbered_not_parsed_again(
    tokenizers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    chat = ChatFormat(tokenizers["tools"], tool_parser="hermes")
    tools = ToolSet([add, echo])
    calls = [("add", {"a": 1, "b": 2}), ("echo", {"text": "hi"})]
    text = "".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )
    response = chat.encode(text)
    fresh = ResponseParser(tokenizers["tools"], tool_parser="hermes", tools=tools.schemas)
    dialogs = [Dialog(chat, tools) for _ in range(3)]
    shared = dialogs[0].parser
    assert shared is not None and all(d.parser is shared for d in dialogs)
    parses: list[int] = []
    parse = shared.parse
    monkeypatch.setattr(
        shared, "parse", lambda text, turn=0: parses.append(turn) or parse(text, turn)
    )
    for turn, dialog in zip([0, 5, 2], dialogs, strict=True):
        dialog.first_prompt("Add, then echo.")
        action = dialog.act(response, turn)
        assert action == fresh.parse(chat.decode_for_parsing(response), turn)
        assert [c.id for c in action.tool_calls] == [f"call_{turn}_0", f"call_{turn}_1"]
        assert dialog.messages[-1] == action.message()
    assert parses == [0]  # parsed once, at the first turn it came


@settings(max_examples=300, deadline=None)
@given(kwargs=st.dictionaries(st.sampled_from(["a", "b", "c", "text"]), st.integers(0, 3)))
def test_arguments_the_schema_lets_through_bind_to_a_tool_bound_by_its_schema(
    kwargs: dict[str, Any],
) -> None:
    tools = ToolSet([add, echo])
    assert tools.bound_by_schema == {"add", "echo"}
    for name in tools.names:
        if argument_problem(tools.parameters(name), kwargs) is None:
            inspect.signature(tools.functions[name]).bind(**kwargs)  # raises if it would not


def test_a_tool_whose_schema_says_less_than_its_signature_is_not_bound_by_it() -> None:
    def spread(*values: int) -> int:
        """Sum the values."""
        return sum(values)

    schema = {"type": "function", "function": {"name": "spread", "parameters": {}}}
    tools = ToolSet([schema], functions={"spread": spread})
    loose = ToolSet(
        [
            {
                "type": "function",
                "function": {
                    "name": "echo",
                    "parameters": {
                        "type": "object",
                        "properties": {"text": {"type": "string"}},
                        "additionalProperties": True,
                    },
                },
            }
        ],
        functions={"echo": echo},
    )
    assert tools.bound_by_schema == frozenset() and loose.bound_by_schema == frozenset()


RAN: list[str] = []


def noted(text: str) -> str:
    """Repeat the text (noted as run).

    Args:
        text: what to repeat
    """
    RAN.append(text)
    return text


noted.blocking = False  # type: ignore[attr-defined]


def failing(text: str) -> str:
    """Raise.

    Args:
        text: ignored
    """
    raise RuntimeError(f"no {text}")


failing.blocking = False  # type: ignore[attr-defined]


def slow_echo(text: str) -> str:
    """Repeat the text on a tool thread.

    Args:
        text: what to repeat
    """
    RAN.append(text)
    return text


CALLS = st.lists(
    st.tuples(
        st.sampled_from(["noted", "failing", "slow_echo", "unknown"]),
        st.one_of(
            st.fixed_dictionaries({"text": TEXT}).map(json.dumps),
            st.just('{"text": 1}'),
            st.just("[1]"),
            st.just("{"),
        ),
    ),
    max_size=3,
)


@settings(max_examples=80, deadline=None)
@given(calls=CALLS, parse_error=st.one_of(st.none(), st.just("bad JSON")))
def test_run_inline_gives_what_run_gives_or_runs_nothing(
    calls: list[tuple[str, str]], parse_error: str | None
) -> None:
    runner = ToolRunner(ToolSet([noted, failing, slow_echo]), max_result_chars=8)
    tool_calls = [ToolCall.from_json(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)]
    action = AssistantAction("", "", tool_calls, parse_error=parse_error)
    try:
        RAN.clear()
        now = runner.run_inline(action)
        ran_now = list(RAN)
        RAN.clear()
        awaited = asyncio.run(runner.run(action))
        ran_awaited = list(RAN)
        again = runner.run_inline(action)  # the calls' checks kept: the same again
    finally:
        runner.close()
    runs = [c for c in tool_calls if c.name == "slow_echo" and c.error is None]
    waits = any(argument_problem(runner.tools.parameters(c.name), c.kwargs) is None for c in runs)
    if waits:  # a call to run on a thread: nothing ran inline
        assert now is None and again is None and ran_now == []
    else:
        assert now is not None and again is not None
        assert attrs.astuple(now) == attrs.astuple(awaited) == attrs.astuple(again)
        assert (
            ran_now
            == ran_awaited
            == [
                c.kwargs.get("text")
                for c in tool_calls
                if c.name == "noted"
                and c.error is None
                and argument_problem(runner.tools.parameters("noted"), c.kwargs) is None
            ]
        )


@pytest.mark.parametrize("inline", [True, False])
def test_a_tool_env_resets_inline_where_its_task_declares_blocking_false(inline: bool) -> None:
    seen: list[str] = []

    def task(seed: int) -> tuple[str, int]:
        seen.append(threading.current_thread().name)
        return "Go.", seed

    if inline:
        task.blocking = False  # type: ignore[attr-defined]
    env = ToolEnv(task, [echo], lambda answer, truth: 0.0)
    threads = EnvThreads(1, "test-env")
    caller = EnvCaller(env, EpisodeSpec(0, 0, 1), threads, 5.0, None, False, Clock())

    async def reset() -> Any:
        return await caller("reset", 0, lambda result: result, 3)

    try:
        assert asyncio.run(reset())[0] == "Go."
    finally:
        threads.close(0.0)
        env.close()
    assert is_blocking(env) is not inline and env.blocking is not inline
    assert (seen == [threading.current_thread().name]) is inline  # the loop's thread


def checked_by_hand(message: Any) -> dict[str, Any] | None:
    """What ``check_messages`` must make of one message (the env contract, written out), or
    None where it must refuse it."""
    if not isinstance(message, dict) or not set(message) <= {"role", "content", *OPTIONAL}:
        return None
    if message.get("role") not in ("user", "tool") or type(message.get("content")) is not str:
        return None  # (a user message's content parts are the general path's, not drawn here)
    if any(message.get(key) is not None and type(message[key]) is not str for key in OPTIONAL):
        return None
    checked = {"role": message["role"], "content": message["content"]}
    checked.update({key: message[key] for key in OPTIONAL if message.get(key) is not None})
    return checked


OPTIONAL = ("tool_call_id", "name")
MESSAGE_VALUES = st.one_of(TEXT, st.none(), st.integers(-2, 2), st.lists(TEXT, max_size=1))
MESSAGE = st.one_of(
    st.dictionaries(
        st.sampled_from(["role", "content", *OPTIONAL, "extra"]),
        st.one_of(st.sampled_from(["user", "tool", "assistant"]), MESSAGE_VALUES),
    ),
    st.builds(  # the usual shape, in the order the tool runner writes it
        lambda *fields: dict(zip(("role", "tool_call_id", "name", "content"), fields, strict=True)),
        st.sampled_from(["tool", "user"]),
        TEXT,
        TEXT,
        TEXT,
    ),
)


@settings(max_examples=400, deadline=None)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=3))
def test_checked_messages_are_the_contract_s_whatever_path_checks_them(
    messages: list[Any],
) -> None:
    """``check_messages``'s short path for plain messages (every value a str) gives what the
    general checks give: the same keys in the same order, and a refusal where they refuse."""
    wanted = [checked_by_hand(m) for m in messages]
    if None in wanted:
        with pytest.raises(ValueError, match=r"Env\.step: observation\[\d\]"):
            check_messages("Env.step: observation", messages)
        return
    got = check_messages("Env.step: observation", messages)
    assert [list(m.items()) for m in got] == [list(m.items()) for m in wanted]  # type: ignore[union-attr]
    assert all(g is not m for g, m in zip(got, messages, strict=True))  # copies: not the env's


NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False), st.integers(-5, 5), st.booleans()
)
METRIC_VALUES = st.one_of(NUMBERS, st.text(max_size=2), st.none())
MODES = st.one_of(st.sampled_from(AGG_MODES), st.text(max_size=2), st.integers(0, 1))


@settings(max_examples=400, deadline=None)
@given(
    raw=st.dictionaries(st.one_of(TEXT, st.integers(0, 2)), METRIC_VALUES, max_size=4),
    modes=st.dictionaries(st.one_of(TEXT, st.integers(0, 2)), MODES, max_size=4),
)
def test_step_metrics_short_path_gives_the_general_answer(
    raw: dict[Any, Any], modes: dict[Any, Any]
) -> None:
    """``step_metrics``: names as str, numbers as floats, modes checked, whether or not every
    name is a str and every value a plain number (the short path's condition)."""
    bad_value = any(isinstance(v, str) or v is None for v in raw.values())
    bad_mode = any(m not in AGG_MODES for m in modes.values())
    info = {"metrics": raw, "metrics_agg_mode": modes}
    if bad_value or bad_mode:
        with pytest.raises(ValueError, match=r"info\['metrics"):
            step_metrics(info)
        return
    values, got_modes = step_metrics(info)
    assert values == {str(k): float(v) for k, v in raw.items()}
    assert all(type(k) is str and type(v) is float for k, v in values.items())
    assert got_modes == {str(k): v for k, v in modes.items()}
