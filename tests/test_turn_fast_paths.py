"""The per-turn shortcuts give exactly what the general paths give: a request's sampling
params, the decoded action text, a scripted engine's cut at stop tokens."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.agent.chat import ChatFormat
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
