"""The per-turn shortcuts give exactly what the general paths give: a request's sampling
params, the decoded action text, a scripted engine's cut at stop tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.records import Turn
from rollpipe.engines import SamplingParams, ScriptedEngine


@given(
    max_tokens=st.integers(1, 10**6),
    seed=st.none() | st.integers(0, 2**31 - 1),
    base_seed=st.none() | st.integers(0, 9),
    stops=st.lists(st.integers(0, 99), max_size=3),
)
def test_for_request_is_replace(max_tokens, seed, base_seed, stops) -> None:
    base = SamplingParams(max_tokens=7, temperature=0.5, stop_token_ids=stops, seed=base_seed)
    fast = base.for_request(max_tokens, seed)
    assert fast == base.replace(max_tokens=max_tokens, seed=seed)
    assert hash(fast) == hash(base.replace(max_tokens=max_tokens, seed=seed))
    assert base.max_tokens == 7 and base.seed == base_seed  # the original is untouched


@pytest.mark.parametrize(("max_tokens", "seed"), [(0, 1), (True, 1), (4, -1), (4, 1.5)])
def test_for_request_checks_what_it_sets(max_tokens: Any, seed: Any) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.(max_tokens|seed)"):
        SamplingParams().for_request(max_tokens, seed)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 600), max_size=40))
def test_decode_is_the_tokenizers_decode(tokenizer, ids) -> None:
    chat = ChatFormat(tokenizer)
    assert chat.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_decode_takes_the_short_path_only_where_it_is_the_same(tokenizer) -> None:
    assert ChatFormat(tokenizer)._fast_decode is not None  # the tiny model's tokenizer
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert ChatFormat(tokenizer)._fast_decode is None  # transformers' decode then
    finally:
        tokenizer.clean_up_tokenization_spaces = False


@settings(max_examples=60, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(["<|im_start|>", "<|im_end|>", "user", "\n", " ", "é", "12", "ab"])
        | st.text(max_size=8),
        max_size=12,
    ).map("".join)
)
def test_encode_is_the_tokenizers_call(tokenizer, text) -> None:
    chat = ChatFormat(tokenizer)
    assert chat._fast_encode is not None  # the tiny model's tokenizer takes the short path
    assert chat.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_encode_takes_the_short_path_only_where_it_is_the_same(tokenizer) -> None:
    tokenizer.split_special_tokens = True
    try:
        chat = ChatFormat(tokenizer)
        assert chat._fast_encode is None  # transformers' __call__ then
        assert (
            chat.encode("<|im_end|>")
            == tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]
        )
    finally:
        tokenizer.split_special_tokens = False


def test_tool_call_arguments_reach_the_template_as_a_dict(tokenizer) -> None:
    """OpenAI messages carry arguments as JSON text; templates get a dict (as vLLM passes
    them), so `| tojson` renders them once, not double-encoded."""
    tokenizer_template = tokenizer.chat_template
    tokenizer.chat_template = (
        "{%- for m in messages %}{{- m['content'] }}{%- for c in m.get('tool_calls') or [] %}"
        "{{- c['function']['arguments'] | tojson }}|{%- endfor %}{%- endfor %}"
    )
    try:
        chat = ChatFormat(tokenizer)
        call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        bad = {"type": "function", "function": {"name": "add", "arguments": "not json"}}
        text = chat.render_messages(
            [{"role": "assistant", "content": "", "tool_calls": [call, bad]}],
            generation_prompt=False,
        )
        assert text == '{"a": 1}|"not json"|'  # text that is no JSON object stays text
        assert call["function"]["arguments"] == '{"a": 1}'  # the caller's message untouched
    finally:
        tokenizer.chat_template = tokenizer_template


@given(
    reply=st.lists(st.integers(0, 9), max_size=12),
    stops=st.lists(st.integers(0, 9), max_size=3),
    max_tokens=st.integers(1, 14),
)
@settings(max_examples=40, deadline=None)
def test_scripted_cut_at_the_first_stop_token(reply, stops, max_tokens) -> None:
    with ScriptedEngine(lambda prompt, params: reply) as engine:
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stops)
        [gen] = engine.generate_batch([[1]], params)
    ids = reply[:max_tokens]
    cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
    assert list(gen.token_ids) == (ids if cut is None else ids[:cut])
    assert gen.finish_reason == ("length" if cut is None else "stop")


@given(
    prompt=st.lists(st.integers(0, 2**40), max_size=20),
    response=st.lists(st.integers(0, 99), max_size=5),
)
def test_a_turn_packed_by_the_episode_is_the_same_turn(prompt, response) -> None:
    """The episode packs a turn's prompt ids once (bounds, then the row): the turn and
    its packed ids are those of a turn that packs them itself."""
    import numpy as np

    from rollpipe.agent.records import Turn
    from rollpipe.engines.inputs import CheckedIds

    fields: dict[str, Any] = {
        "prompt_ids": prompt,
        "response_ids": response,
        "logprobs": [0.0] * len(response),
        "versions": [0] * len(response),
        "reward": 1.0,
        "finish_reason": "stop",
        "action_valid": True,
        "action_text": "a",
        "observation": "o",
    }
    packed = np.fromiter(prompt, np.int64, len(prompt))
    fast, plain = Turn(**fields, prompt_array=packed), Turn(**fields)
    assert fast == plain and hash(fast) == hash(plain)
    assert fast.token_array.tolist() == plain.token_array.tolist() == prompt + response
    assert not fast.token_array.flags.writeable
    ids, checked = CheckedIds([3]), CheckedIds([3])
    ids.extend_packed(prompt, packed)
    checked.extend_checked(prompt, trusted=True)
    assert ids == checked and (ids.low, ids.high) == (checked.low, checked.high)


def test_packed_ids_must_be_the_ids() -> None:
    import numpy as np

    from rollpipe.engines.inputs import CheckedIds

    with pytest.raises(ValueError, match="2 packed ids for 3 ids"):
        CheckedIds().extend_packed([1, 2, 3], np.array([1, 2]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        CheckedIds().extend_packed([1, -2], np.array([1, -2]))


@settings(max_examples=40, deadline=None)
@given(
    observation=st.text(max_size=30),
    cut=st.booleans(),  # the last response lacks the end-of-turn token (cut at max_tokens)
    first=st.booleans(),
)
def test_packed_turn_prompt_is_the_turn_prompt(tokenizer, observation, cut, first) -> None:
    chat = ChatFormat(tokenizer)
    response = [*tokenizer.encode("ok"), *([] if cut else [chat.eot_id])]
    history = [] if first else [_turn(response)]
    ids, packed = chat.packed_turn_prompt(observation, history)
    assert list(ids) == chat.turn_prompt(observation, history)
    assert packed.dtype == np.int64 and packed.tolist() == list(ids)
    # shared by every turn that repeats the observation: immutable, and not copied
    assert isinstance(ids, tuple) and not packed.flags.writeable
    again, packed_again = chat.packed_turn_prompt(observation, history)
    assert again is ids and packed_again is packed
    # the public lists are fresh: callers may extend them
    assert chat.turn_prompt(observation, history) is not chat.turn_prompt(observation, history)


def test_packed_turn_prompt_in_window_mode_is_the_turn_prompt_unpacked(tokenizer) -> None:
    chat = ChatFormat(tokenizer, history_window=2)
    history = [_turn([*tokenizer.encode("ok"), chat.eot_id])]
    assert chat.packed_turn_prompt("x", history) == (chat.turn_prompt("x", history), None)


def _turn(response: list[int]) -> Turn:
    n = len(response)
    return Turn(
        prompt_ids=[1],
        response_ids=response,
        logprobs=[0.0] * n,
        versions=[0] * n,
        reward=0.0,
        finish_reason="stop",
        action_valid=True,
        action_text="ok",
        observation="o",
    )
