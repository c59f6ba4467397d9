"""Request checking without a server: any JSON body is either a ChatRequest or a
RequestError naming a field, never another exception (which would be a 500)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpipe.frontdoor.requests import ChatRequest, RequestError, parse_chat_request

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
KEYS = st.sampled_from(
    [
        "model",
        "messages",
        "tools",
        "tool_choice",
        "n",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "seed",
        "logprobs",
        "top_logprobs",
        "stop",
        "chat_template",
        "stream_options",
        "ignore_eos",
    ]
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "robot"])},
    optional={"content": JSON, "tool_calls": JSON, "tool_call_id": JSON, "name": JSON},
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(KEYS, JSON, max_size=6),
    st.lists(MESSAGE, max_size=3),
    st.booleans(),
)
def test_any_body_is_a_request_or_an_error_naming_a_field(
    body: dict[str, Any], messages: list[dict[str, Any]], well_formed_head: bool
) -> None:
    if well_formed_head:
        body = {**body, "model": "m", "messages": messages}
    try:
        request = parse_chat_request(body)
    except RequestError as error:
        assert error.status == 400 and error.message
        assert error.param is None or error.param.split("[")[0].split(".")[0] in {
            "model",
            "messages",
            "tools",
            "tool_choice",
            "n",
            "stream",
            "temperature",
            "top_p",
            "top_k",
            "max_tokens",
            "seed",
            "logprobs",
            "top_logprobs",
            "stop",
            "chat_template",
            "stream_options",
            "max_completion_tokens",
            "ignore_eos",
        }
        return
    assert isinstance(request, ChatRequest) and request.messages


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(RequestError, match="JSON object"):
        parse_chat_request([1, 2])
