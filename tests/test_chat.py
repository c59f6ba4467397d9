"""ChatFormat on the tiny model's real tokenizer and chat template."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.records import Turn

TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40
)
FIXTURE_OK = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_eot_is_the_templates_end_of_turn_token(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    assert chat.eot_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_first_prompt_matches_the_template(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, system_prompt="Be brief.", instruction="Play well.")
    ids = chat.first_prompt("P_G")
    assert ids == template_ids(
        tokenizer,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Play well.\n\nP_G"},
        ],
    )
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    no_system = ChatFormat(tokenizer, system_prompt=None).first_prompt("x")
    assert tokenizer.decode(no_system) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


@FIXTURE_OK
@given(obs=st.lists(TEXT, min_size=2, max_size=4), answers=st.lists(TEXT, min_size=3, max_size=3))
def test_appended_turns_equal_the_whole_conversation_rendered(
    tokenizer: Any, obs: list[str], answers: list[str]
) -> None:
    """first prompt + (response + continuation)* is what the template renders for the
    whole conversation, whether or not the response ended with the end-of-turn token."""
    chat = ChatFormat(tokenizer)
    ids = chat.first_prompt(obs[0])
    messages = [
        {"role": "system", "content": chat.system_prompt or ""},
        {"role": "user", "content": obs[0]},
    ]
    for i, o in enumerate(obs[1:]):
        response = list(tokenizer(answers[i], add_special_tokens=False)["input_ids"])
        if i % 2 == 0:  # stopped at end of turn; odd turns were cut at max_tokens
            response.append(chat.eot_id)
        ids += response + chat.continuation(o, response)
        messages += [{"role": "assistant", "content": answers[i]}, {"role": "user", "content": o}]
    assert ids == template_ids(tokenizer, messages)


def test_continuation_adds_end_of_turn_only_when_missing(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    eot = chat.eot_id
    after_stop = chat.continuation("next", [5, eot])
    after_cut = chat.continuation("next", [5, 6])
    assert after_cut == [eot, *after_stop]
    assert (
        tokenizer.decode(after_stop)
        == "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.turn_prompt("next", [_turn("o", [5, eot])]) == after_stop


def _turn(obs: str, response: list[int], action: str = "<answer>Up</answer>") -> Turn:
    n = len(response)
    return Turn([1], response, [0.0] * n, [0] * n, -0.1, "stop", False, action, obs)


def test_window_prompt_shows_task_and_only_the_last_k_turns(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, history_window=2)
    history = [_turn(f"OBS{i}", [5], f"ACT{i}") for i in range(4)]
    text = tokenizer.decode(chat.turn_prompt("NOW", history))
    assert "ACT2" in text and "ACT3" in text and "ACT1" not in text and "ACT0" not in text
    assert "The task, as first shown:\nOBS0" in text  # turn 0 fell out of the window
    assert text.index("ACT3") < text.index("Step 4. Current observation:\nNOW")
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>user") == 1
    # the prompt size does not grow with the episode
    longer = [_turn(f"OBS{i}", [5], f"ACT{i}") for i in range(9)]
    assert abs(len(chat.turn_prompt("NOW", longer)) - len(chat.turn_prompt("NOW", history))) <= 2
    first = tokenizer.decode(chat.turn_prompt("START", []))
    assert "START" in first and "task" not in first and "ACT" not in first
    assert "ACT" not in tokenizer.decode(
        ChatFormat(tokenizer, history_window=0).turn_prompt("N", history)
    )


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_history_window_must_be_none_or_non_negative_int(tokenizer: Any, bad: object) -> None:
    with pytest.raises(ValueError, match=r"ChatFormat\.history_window"):
        ChatFormat(tokenizer, history_window=bad)  # type: ignore[arg-type]


def test_decode_drops_special_tokens(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer)
    ids = list(tokenizer("<answer>Left</answer>", add_special_tokens=False)["input_ids"])
    assert chat.decode([*ids, chat.eot_id]) == "<answer>Left</answer>"


def test_tokenizer_without_chat_template_is_rejected(tokenizer: Any) -> None:
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        ChatFormat(bare)


@FIXTURE_OK
@given(observations=st.lists(st.sampled_from(["a", "b", "P_G", "grid\nrow"]) | TEXT, max_size=12))
def test_cached_prompts_equal_fresh_renderings(tokenizer: Any, observations: list[str]) -> None:
    """The per-observation caches never change what a prompt is, even when a caller
    mutates the list it got back (every call returns a new list)."""
    shared = ChatFormat(tokenizer)
    for obs in observations:
        fresh = ChatFormat(tokenizer)
        first, cont = shared.first_prompt(obs), shared.continuation(obs, [5])
        assert first == fresh.first_prompt(obs)
        assert cont == fresh.continuation(obs, [5])
        first.append(-1)
        cont.clear()
        assert shared.first_prompt(obs) == fresh.first_prompt(obs)
        assert shared.continuation(obs, [5]) == fresh.continuation(obs, [5])


def test_chat_format_pickles_with_its_settings(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, system_prompt="Be brief.", history_window=2)
    chat.first_prompt("warm the cache")
    back = pickle.loads(pickle.dumps(chat))
    assert back == chat
    assert back.eot_id == chat.eot_id
    assert back.first_prompt("x") == chat.first_prompt("x")
    assert back.continuation("y", [5]) == chat.continuation("y", [5])
